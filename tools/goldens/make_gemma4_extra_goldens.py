"""Extra gemma4 goldens, run on the device machine (transformers 5.17.0, torch 2.11, CPU float32,
eager) exactly as below: python3 make_gemma4_extra_goldens.py OUT -> OUT/targets/<name>/
{config.json, model.safetensors, golden.safetensors (input_ids, logits, hidden_{k}), golden.json}.

- gemma4_wide: use_double_wide_mlp with 3 KV-shared layers (two sliding layers share one owner),
  attention biases, untied LM head, proportional rope with factor 2 and partial_rotary_factor 0.5,
  global_head_dim (no per_layer_config in the kwargs).
- gemma4_mm: Gemma4ForConditionalGeneration (config under text_config, tensors under
  model.language_model.), text-only input.

Random init: matrices N(0,0.12), embeddings N(0,0.3), other 1-D N(0,0.1), norm weights
U[0.5,1.5], layer_scalar U[0.5,1.5]. Kept compact (it was sent inline to the device machine).
"""
import json,os,sys,torch,transformers as tf
from safetensors.torch import save_file
torch.set_num_threads(1)
V=256;T=41;O=sys.argv[1]
b=dict(vocab_size=V,hidden_size=64,max_position_embeddings=512,rms_norm_eps=1e-6,bos_token_id=None,eos_token_id=None,pad_token_id=None)
S,F="sliding_attention","full_attention"
C={"gemma4_wide":dict(b,intermediate_size=48,num_hidden_layers=5,num_attention_heads=4,num_key_value_heads=2,head_dim=16,global_head_dim=32,attention_k_eq_v=False,attention_bias=True,sliding_window=6,layer_types=[S,F,S,S,F],rope_parameters={S:{"rope_type":"default","rope_theta":1000.0},F:{"rope_type":"proportional","partial_rotary_factor":0.5,"rope_theta":10000.0,"factor":2.0}},hidden_size_per_layer_input=8,vocab_size_per_layer_input=V,num_kv_shared_layers=3,use_double_wide_mlp=True,final_logit_softcapping=None,tie_word_embeddings=False),
"gemma4_mm":dict(b,pad_token_id=0,intermediate_size=128,num_hidden_layers=6,num_attention_heads=4,num_key_value_heads=2,head_dim=16,global_head_dim=32,num_global_key_value_heads=1,attention_k_eq_v=True,sliding_window=8,layer_types=[S,S,F,S,S,F],hidden_size_per_layer_input=8,vocab_size_per_layer_input=V,num_kv_shared_layers=2,final_logit_softcapping=30.0,tie_word_embeddings=True)}
for i,(n,kw) in enumerate(C.items()):
 s=400+i;tc=tf.Gemma4TextConfig(**kw)
 if n=="gemma4_mm":cfg=tf.Gemma4Config(text_config=tc.to_dict(),vision_config=None,audio_config=None,tie_word_embeddings=True);cls=tf.Gemma4ForConditionalGeneration
 else:cfg=tc;cls=tf.Gemma4ForCausalLM
 torch.manual_seed(s);m=cls._from_config(cfg,attn_implementation="eager",dtype=torch.float32).eval()
 g=torch.Generator().manual_seed(s)
 with torch.no_grad():
  for k,p in m.named_parameters():
   v=torch.rand(p.shape,generator=g)+0.5 if p.ndim==1 and "norm" in k else torch.randn(p.shape,generator=g)*(0.1 if p.ndim==1 else 0.3 if "embed_tokens" in k else 0.12)
   p.copy_(v)
  for k,x in m.named_buffers():
   if k.endswith("layer_scalar"):x.copy_(torch.rand(x.shape,generator=g)+0.5)
 d=f"{O}/targets/{n}";os.makedirs(d,exist_ok=True);m.save_pretrained(d)
 for e in os.listdir(d):
  if e not in("config.json","model.safetensors"):os.remove(f"{d}/{e}")
 r=cls.from_pretrained(d,dtype=torch.float32,attn_implementation="eager").eval()
 L=kw["num_hidden_layers"];tp=[0,L-2];ids=torch.randint(1,V,(T,),generator=g)
 with torch.inference_mode():o=r(input_ids=ids[None],output_hidden_states=True);ref=m(input_ids=ids[None]).logits
 assert torch.allclose(o.logits,ref,atol=1e-5) and len(o.hidden_states)==L+1
 t={"input_ids":ids,"logits":o.logits[0].float().contiguous()}
 for k in tp:t[f"hidden_{k}"]=o.hidden_states[k+1][0].contiguous()
 save_file(t,f"{d}/golden.safetensors",metadata={"format":"pt"})
 json.dump({"taps":tp,"T":T,"model_class":cls.__name__,"transformers":tf.__version__,"torch":torch.__version__,"notes":"made by tools/goldens/make_gemma4_extra_goldens.py (compact inline copy); CPU f32 eager"},open(f"{d}/golden.json","w"),indent=1)
 print(n,"ok",float(o.logits.std()))
