// A minimal driver for llama.cpp's own diffusion sampling loop (examples/diffusion/diffusion.cpp,
// diffusion_generate(), compiled unchanged from the llama-cpp-python sdist) for `localdiff bench --only gguf`.
//
// It replaces only diffusion-cli.cpp's command-line front end: the full program needs llama-common (~60 heavy
// files: arguments, chat templates, downloads), which takes over an hour to compile on one core here. What
// diffusion-cli.cpp does around the loop is reproduced: load the model, refuse a non-diffusion model, one context
// with n_ctx = n_batch = n_ubatch = max_length, flash attention off, threads, the mask token from the vocabulary,
// diffusion.shift_logits from the metadata (default true), the same diffusion_params. The prompt arrives as token
// ids on stdin (the caller tokenizes with the same GGUF vocabulary and chat template), the result goes to stdout as
// token ids; diffusion_generate's own "total time" log line and its CPU time ("cpu time", all threads of the
// process: unlike wall time it does not grow when other processes share the core) go to stderr.
//
// The two pieces of llama-common that diffusion.cpp links against are written here: common_batch (the batch
// builder: tokens, positions, output flags → llama_batch_ext) and the log entry points (printf to stderr).
//
// usage: driver MODEL THREADS MAX_LENGTH STEPS BLOCK_LENGTH EPS ALGORITHM TOP_K SEED < prompt_ids
#include "common.h"
#include "diffusion.h"
#include "log.h"

#include <cstdarg>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <ctime>
#include <iostream>
#include <vector>

// -- llama-common stand-ins -----------------------------------------------------------------------------------
static int g_verbosity = LOG_DEFAULT_LLAMA;
int common_log_get_verbosity_thold(void) { return g_verbosity; }
struct common_log * common_log_main() { return nullptr; }
void common_log_add(struct common_log *, enum ggml_log_level, const char * fmt, ...) {
    va_list ap;
    va_start(ap, fmt);
    vfprintf(stderr, fmt, ap);
    va_end(ap);
}

common_batch::common_batch(llama_context * ctx) : batch(llama_batch_ext_init(ctx)) {}

void common_batch::clear() { tokens.clear(); }

int32_t common_batch::add(llama_token id, llama_pos pos, llama_seq_id seq_id, bool output) {
    token t{};
    t.id = id;
    t.pos = { pos, 0, 0, 0 };
    t.seq_id = seq_id;
    t.output = output;
    tokens.push_back(t);
    return (int32_t) tokens.size() - 1;
}

llama_batch_ext * common_batch::get_sub_batch(int32_t off, int32_t n) {
    llama_batch_ext * b = batch.get();
    llama_batch_ext_clear(b);
    for (int32_t i = off; i < off + n; ++i) {
        const int32_t k = llama_batch_ext_add_token(b, tokens[i].seq_id, tokens[i].id);
        if (k < 0) {
            fprintf(stderr, "driver: batch full at %d\n", i);
            std::exit(3);
        }
        llama_batch_ext_set_pos(b, k, tokens[i].pos.data());
        if (tokens[i].output) {
            llama_batch_ext_set_output_logits(b, k, true);
        }
    }
    return b;
}

static void quiet(enum ggml_log_level level, const char * text, void *) {
    if (level >= GGML_LOG_LEVEL_WARN && level != GGML_LOG_LEVEL_CONT) {
        fputs(text, stderr);
    }
}

int main(int argc, char ** argv) {
    if (argc != 10) {
        fprintf(stderr, "usage: %s MODEL THREADS MAX_LENGTH STEPS BLOCK_LENGTH EPS ALGORITHM TOP_K SEED < ids\n", argv[0]);
        return 2;
    }
    const int threads = atoi(argv[2]), max_length = atoi(argv[3]), steps = atoi(argv[4]);
    const int block_length = atoi(argv[5]), algorithm = atoi(argv[7]), top_k = atoi(argv[8]), seed = atoi(argv[9]);
    const float eps = (float) atof(argv[6]);
    std::vector<llama_token> prompt;
    for (long v; std::cin >> v;) {
        prompt.push_back((llama_token) v);
    }
    llama_log_set(quiet, nullptr);
    llama_backend_init();
    llama_model_params mp = llama_model_default_params();
    mp.n_gpu_layers = 0;
    llama_model * model = llama_model_load_from_file(argv[1], mp);
    if (!model || !llama_model_is_diffusion(model)) {
        fprintf(stderr, "driver: cannot load %s as a diffusion model\n", argv[1]);
        return 1;
    }
    llama_context_params cp = llama_context_default_params();
    cp.n_ctx = cp.n_batch = cp.n_ubatch = max_length;
    cp.flash_attn_type = LLAMA_FLASH_ATTN_TYPE_DISABLED;
    cp.no_perf = true;
    llama_context * ctx = llama_init_from_model(model, cp);
    if (!ctx || prompt.empty() || (int) prompt.size() >= max_length) {
        fprintf(stderr, "driver: no context, or a prompt of %zu tokens for max_length %d\n", prompt.size(), max_length);
        return 1;
    }
    llama_set_n_threads(ctx, threads, threads);

    diffusion_params p;
    char shift[8];
    p.shift_logits = llama_model_meta_val_str(model, "diffusion.shift_logits", shift, sizeof(shift)) >= 0
                         ? strcmp(shift, "true") == 0 : true;
    if (block_length > 0) {
        p.schedule = DIFFUSION_TRANSFER_SCHEDULE_BLOCK_BASED;
        p.block_length = block_length;
    } else {
        p.schedule = DIFFUSION_TRANSFER_SCHEDULE_TIMESTEP_BASED;
        p.eps = eps;
    }
    p.mask_token_id = llama_vocab_mask(llama_model_get_vocab(model));
    p.seed = seed;
    p.temperature = 0.0f;   // diffusion-cli's --temp 0
    p.top_k = top_k;        // its --top-k (default 40); top_p stays at its 0.95 default as in the program
    p.top_p = 0.95f;
    p.steps = steps;
    p.algorithm = (diffusion_algorithm) algorithm;
    p.max_length = max_length;
    std::vector<llama_token> out(max_length);
    int32_t n_generated = 0;
    timespec c0, c1;
    clock_gettime(CLOCK_PROCESS_CPUTIME_ID, &c0);
    diffusion_generate(ctx, prompt.data(), out.data(), (int32_t) prompt.size(), p, n_generated);
    clock_gettime(CLOCK_PROCESS_CPUTIME_ID, &c1);
    fprintf(stderr, "cpu time: %.3f ms\n", (c1.tv_sec - c0.tv_sec) * 1e3 + (c1.tv_nsec - c0.tv_nsec) / 1e6);
    for (int i = (int) prompt.size(); i < max_length; ++i) {
        printf("%d ", out[i]);
    }
    printf("\n");
    llama_free(ctx);
    llama_model_free(model);
    return 0;
}
