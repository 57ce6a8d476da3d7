// Greedy token ids from llama.cpp for fixture files: for each prompt (one JSON string per
// line on stdin, already in the model's chat format when wanted), print one JSON object
// per line: {"prompt": ..., "prompt_ids": [...], "ids": [...]}. Generation stops after N
// tokens or at an end-of-generation token (included). Prompt text is tokenized with
// special-token parsing and the model's own BOS rule. KV cache in f32, flash attention
// off. Only llama.h is used.
//
// Build: see make_fixtures.sh. Usage: greedy_ids MODEL.gguf N < prompts.jsonl
#include "llama.h"
#include <cstdio>
#include <cstdlib>
#include <iostream>
#include <string>
#include <vector>

// Minimal JSON string decode/encode (prompts are plain text with \n, \" and \\ escapes).
static std::string json_unquote(const std::string & s) {
    std::string out;
    size_t i = s.find('"') + 1;
    for (; i < s.size() && s[i] != '"'; i++) {
        if (s[i] == '\\' && i + 1 < s.size()) {
            char c = s[++i];
            out += c == 'n' ? '\n' : c == 't' ? '\t' : c;
        } else {
            out += s[i];
        }
    }
    return out;
}
static std::string json_quote(const std::string & s) {
    std::string out = "\"";
    for (char c : s) {
        if (c == '"' || c == '\\') { out += '\\'; out += c; }
        else if (c == '\n') out += "\\n";
        else if (c == '\t') out += "\\t";
        else out += c;
    }
    return out + "\"";
}
static std::string ids_json(const std::vector<llama_token> & v) {
    std::string s = "[";
    for (size_t i = 0; i < v.size(); i++) s += (i ? "," : "") + std::to_string(v[i]);
    return s + "]";
}

int main(int argc, char ** argv) {
    if (argc < 3) { fprintf(stderr, "usage: %s MODEL.gguf N < prompts.jsonl\n", argv[0]); return 1; }
    const int n_predict = atoi(argv[2]);
    llama_log_set([](enum ggml_log_level, const char *, void *) {}, nullptr);
    ggml_backend_load_all();
    llama_model_params mp = llama_model_default_params();
    llama_model * model = llama_model_load_from_file(argv[1], mp);
    if (!model) { fprintf(stderr, "cannot load %s\n", argv[1]); return 1; }
    const llama_vocab * vocab = llama_model_get_vocab(model);
    const int n_vocab = llama_vocab_n_tokens(vocab);
    std::string line;
    while (std::getline(std::cin, line)) {
        if (line.find('"') == std::string::npos) continue;
        std::string prompt = json_unquote(line);
        int n = -llama_tokenize(vocab, prompt.c_str(), prompt.size(), nullptr, 0, true, true);
        std::vector<llama_token> toks(n);
        llama_tokenize(vocab, prompt.c_str(), prompt.size(), toks.data(), n, true, true);
        llama_context_params cp = llama_context_default_params();
        cp.n_ctx = 1024;
        cp.n_batch = 1024;
        cp.n_threads = 2;
        cp.n_threads_batch = 2;
        // f32 KV cache, no flash attention: the closest llama.cpp gets to exact attention.
        cp.type_k = GGML_TYPE_F32;
        cp.type_v = GGML_TYPE_F32;
        cp.flash_attn_type = LLAMA_FLASH_ATTN_TYPE_DISABLED;
        llama_context * ctx = llama_init_from_model(model, cp);
        std::vector<llama_token> prompt_ids = toks, out;
        llama_batch batch = llama_batch_get_one(toks.data(), toks.size());
        llama_token next = 0;
        for (int i = 0; i < n_predict; i++) {
            if (llama_decode(ctx, batch)) { fprintf(stderr, "decode failed\n"); return 1; }
            const float * logits = llama_get_logits_ith(ctx, -1);
            next = 0;
            for (int t = 1; t < n_vocab; t++) if (logits[t] > logits[next]) next = t;
            out.push_back(next);
            if (llama_vocab_is_eog(vocab, next)) break;
            batch = llama_batch_get_one(&next, 1);
        }
        printf("{\"prompt\": %s, \"prompt_ids\": %s, \"ids\": %s}\n", json_quote(prompt).c_str(),
               ids_json(prompt_ids).c_str(), ids_json(out).c_str());
        fflush(stdout);
        llama_free(ctx);
    }
    llama_model_free(model);
    return 0;
}
