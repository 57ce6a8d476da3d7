// Dump every f32 tensor llama.cpp computes (its eval callback) for one prompt's prefill and
// then greedy one-token steps, for a layer-by-layer / op-by-op comparison with dflash
// (crates/dflash/examples/llama_ops.rs; docs/perf.md, session 51). Writes DIR/index.txt, one
// line per tensor: "seq step name op ne0 ne1 ne2 ne3 src0 src1" (names may hold spaces), and
// DIR/SEQ.bin, the tensor's f32 values in ggml's logical order (ne0 fastest). Same context
// settings as greedy_ids.cpp (f32 KV cache, no flash attention, 2 threads). Prints the greedy
// ids. Every tensor of every step is written: ~1.8 GB for 20 prompt tokens + 18 steps on
// SmolLM2-135M (the KV cache views dominate).
//
// Build like greedy_ids (make_fixtures.sh), e.g.
//   g++ -O2 -std=c++17 -I$LLAMA_CPP/include -I$LLAMA_CPP/ggml/include dump_tensors.cpp \
//       -L$LLAMA_CPP/build/bin -lllama -lggml -lggml-base -Wl,-rpath,$LLAMA_CPP/build/bin -o dump_tensors
// Usage: dump_tensors MODEL.gguf ID,ID,... N_STEPS DIR
#include "llama.h"
#include "ggml.h"
#include "ggml-backend.h"
#include <cstdio>
#include <cstdlib>
#include <string>
#include <vector>
#include <sstream>
struct S { std::string dir; FILE * idx; int seq = 0; int step = 0; };
static bool cb(struct ggml_tensor * t, bool ask, void * ud) {
    S * s = (S *) ud;
    if (ask) return true;
    if (t->type != GGML_TYPE_F32) return true;
    std::vector<float> v(ggml_nelements(t));
    size_t i = 0;
    for (int64_t a3 = 0; a3 < t->ne[3]; a3++) for (int64_t a2 = 0; a2 < t->ne[2]; a2++)
    for (int64_t a1 = 0; a1 < t->ne[1]; a1++) for (int64_t a0 = 0; a0 < t->ne[0]; a0++)
        v[i++] = *(float *)((char *) t->data + a0*t->nb[0] + a1*t->nb[1] + a2*t->nb[2] + a3*t->nb[3]);
    char fn[512]; snprintf(fn, sizeof fn, "%s/%05d.bin", s->dir.c_str(), s->seq);
    FILE * f = fopen(fn, "wb"); fwrite(v.data(), 4, v.size(), f); fclose(f);
    fprintf(s->idx, "%d %d %s %s %lld %lld %lld %lld %s %s\n", s->seq, s->step, t->name, ggml_op_desc(t),
        (long long) t->ne[0], (long long) t->ne[1], (long long) t->ne[2], (long long) t->ne[3],
        t->src[0] ? t->src[0]->name : "-", t->src[1] ? t->src[1]->name : "-");
    s->seq++;
    return true;
}
int main(int argc, char ** argv) {
    S s; s.dir = argv[4]; s.idx = fopen((s.dir + "/index.txt").c_str(), "w");
    int n_predict = atoi(argv[3]);
    std::vector<llama_token> toks; { std::stringstream ss(argv[2]); std::string x; while (std::getline(ss, x, ',')) toks.push_back(atoi(x.c_str())); }
    llama_log_set([](enum ggml_log_level, const char *, void *) {}, nullptr);
    ggml_backend_load_all();
    llama_model * model = llama_model_load_from_file(argv[1], llama_model_default_params());
    const int n_vocab = llama_vocab_n_tokens(llama_model_get_vocab(model));
    llama_context_params cp = llama_context_default_params();
    cp.n_ctx = 1024; cp.n_batch = 1024; cp.n_threads = 2; cp.n_threads_batch = 2;
    cp.type_k = GGML_TYPE_F32; cp.type_v = GGML_TYPE_F32;
    cp.flash_attn_type = LLAMA_FLASH_ATTN_TYPE_DISABLED;
    cp.cb_eval = cb; cp.cb_eval_user_data = &s;
    llama_context * ctx = llama_init_from_model(model, cp);
    llama_batch batch = llama_batch_get_one(toks.data(), toks.size());
    llama_token next;
    for (int i = 0; i < n_predict; i++) {
        s.step = i;
        if (llama_decode(ctx, batch)) { fprintf(stderr, "decode failed\n"); return 1; }
        const float * l = llama_get_logits_ith(ctx, -1);
        next = 0; for (int t = 1; t < n_vocab; t++) if (l[t] > l[next]) next = t;
        printf("%d%s", next, i + 1 < n_predict ? "," : "\n");
        batch = llama_batch_get_one(&next, 1);
    }
    fclose(s.idx);
}
