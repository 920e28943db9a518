/*
 * st_engine.h - Strata's attached inference engine: GGUF files, models of the architectures it
 * knows (strata-hybrid today: Gated DeltaNet + grouped-query attention), a byte-level tokenizer,
 * backends behind a table of function pointers (CPU and CUDA), slots with a conversation cache
 * of running-state checkpoints, and snapshot / restore of a slot to and from an st_image.
 *
 * Threads: an st_model is immutable after loading and may be shared. An st_engine serialises
 * compute internally (one slot computes at a time; its thread pool does the parallel work), so
 * slots of one engine may be used from different threads, but one slot must be used by one
 * thread at a time. The GGUF reader is immutable after opening.
 *
 * Determinism: with the same model, the same tokens and the same options, every logit is
 * bit-identical whatever the thread count, the --ubatch chunking and the instruction set used
 * (see docs/ENGINE.md, "Determinism rules").
 *
 * Errors: see st_codec.h. Every function that fails records a detail (st_errdetail()).
 */
#ifndef ST_ENGINE_H
#define ST_ENGINE_H

#include <stddef.h>
#include <stdint.h>

#include "st_codec.h"
#include "st_image.h"

#ifdef __cplusplus
extern "C" {
#endif

/* ---- GGUF ---------------------------------------------------------------------------------
 * Reader: the file is mapped read-only; every count, length, type, dimension and offset is
 * checked against the bytes of the file before use. Versions 2 and 3 are read; general.alignment
 * (u32, a power of two) defaults to 32. Errors: ST_ENOTSTRATA (not a GGUF file: bad magic),
 * ST_EVERSION, ST_ECORRUPT (structure; the detail names the field and offset), ST_ETOOBIG,
 * an errno. */
typedef enum st_gguf_type {
    ST_GGUF_UINT8 = 0,
    ST_GGUF_INT8 = 1,
    ST_GGUF_UINT16 = 2,
    ST_GGUF_INT16 = 3,
    ST_GGUF_UINT32 = 4,
    ST_GGUF_INT32 = 5,
    ST_GGUF_FLOAT32 = 6,
    ST_GGUF_BOOL = 7,
    ST_GGUF_STRING = 8,
    ST_GGUF_ARRAY = 9,
    ST_GGUF_UINT64 = 10,
    ST_GGUF_INT64 = 11,
    ST_GGUF_FLOAT64 = 12,
} st_gguf_type;

/* ggml tensor types this engine computes with; the reader knows the sizes of every standard
 * ggml type so that any GGUF file can be opened and listed. */
#define ST_GGML_F32 0
#define ST_GGML_F16 1
#define ST_GGML_BF16 30

#define ST_GGUF_MAX_DIMS 4
#define ST_GGUF_DEFAULT_ALIGNMENT 32

typedef struct st_gguf st_gguf;

typedef struct st_gguf_tensor {
    const char *name;    /* NUL-terminated copy owned by the reader */
    uint32_t type;       /* ggml type */
    uint32_t n_dims;
    uint64_t dims[ST_GGUF_MAX_DIMS]; /* ne[0] is the fastest-varying (row length) */
    uint64_t offset;     /* relative to the data section */
    uint64_t nbytes;
    const void *data;    /* inside the mapping, valid until st_gguf_close */
    uint32_t part;       /* the part of a split model holding it (0: the first) */
} st_gguf_tensor;

/* Open a GGUF file. The first part of a split model (llama.cpp's gguf-split layout:
 * NAME-00001-of-0000N.gguf with split.no 0, split.count N, split.tensors.count T) opens every
 * part by name, each mapped: the keys are the first part's, the tensors those of all parts.
 * ST_EINVAL naming the part for a later part given, a part missing, of another model (split.no,
 * split.count, split.tensors.count, general.architecture) or a tensor in two parts. */
int st_gguf_open(const char *path, st_gguf **out);
/* Parts of a split model (1 otherwise), the path and size of part i (0: the opened file). */
uint32_t st_gguf_n_parts(const st_gguf *g);
const char *st_gguf_part_path(const st_gguf *g, uint32_t i);
uint64_t st_gguf_part_bytes(const st_gguf *g, uint32_t i);
/* Write the model opened from `in` (one file or a split model) as parts of at most max_tensors
 * tensors each, PREFIX-00001-of-0000N.gguf ... (llama.cpp's gguf-split --split-max-tensors
 * layout: every key in the first part, split.no / split.count / split.tensors.count in each).
 * Each part is written atomically, the first last; *n_parts (may be NULL) gets N. */
int st_gguf_split(const char *in, const char *prefix, uint32_t max_tensors, uint32_t *n_parts);
/* Parse a buffer the caller keeps alive and unchanged until st_gguf_close. */
int st_gguf_open_mem(const void *buf, size_t len, st_gguf **out);
void st_gguf_close(st_gguf *g); /* accepts NULL */

uint32_t st_gguf_version(const st_gguf *g);
uint32_t st_gguf_alignment(const st_gguf *g);
uint64_t st_gguf_n_kv(const st_gguf *g);
uint64_t st_gguf_n_tensors(const st_gguf *g);
/* Key i's name and type (ST_GGUF_ARRAY for arrays; *elem_type and *count describe them). */
const char *st_gguf_kv_key(const st_gguf *g, uint64_t i);
uint32_t st_gguf_kv_type(const st_gguf *g, uint64_t i, uint32_t *elem_type, uint64_t *count);
/* Index of a key, or -1. */
int64_t st_gguf_find(const st_gguf *g, const char *key);
/* Typed getters: ST_ENOTFOUND if absent, ST_ECORRUPT (with detail) if of another type. Integer
 * getters accept any integer type whose value fits. The string is not NUL-terminated in the
 * file: *out points into the mapping, *len is its length. */
int st_gguf_get_u32(const st_gguf *g, const char *key, uint32_t *out);
int st_gguf_get_u64(const st_gguf *g, const char *key, uint64_t *out);
int st_gguf_get_f32(const st_gguf *g, const char *key, float *out);
int st_gguf_get_str(const st_gguf *g, const char *key, const char **out, uint64_t *len);
const st_gguf_tensor *st_gguf_tensor_at(const st_gguf *g, uint64_t i);
const st_gguf_tensor *st_gguf_tensor_find(const st_gguf *g, const char *name);
const char *st_gguf_type_name(uint32_t ggml_type);   /* "f32", "q4_K", ...; "unknown" */
const char *st_gguf_kv_type_name(uint32_t kv_type);

/* Writer: collects keys and tensors, then writes a GGUF v3 file atomically (temp file in the
 * same directory, fsync, rename, directory fsync). Tensor data is borrowed until the write. */
typedef struct st_gguf_writer st_gguf_writer;
int st_gguf_writer_new(st_gguf_writer **out, uint32_t alignment /* 0: 32 */);
void st_gguf_writer_free(st_gguf_writer *w); /* accepts NULL */
int st_gguf_writer_set_str(st_gguf_writer *w, const char *key, const char *val);
int st_gguf_writer_set_u32(st_gguf_writer *w, const char *key, uint32_t val);
int st_gguf_writer_set_u64(st_gguf_writer *w, const char *key, uint64_t val);
int st_gguf_writer_set_f32(st_gguf_writer *w, const char *key, float val);
int st_gguf_writer_set_bool(st_gguf_writer *w, const char *key, int val);
/* An array of n strings (copied). */
int st_gguf_writer_set_str_arr(st_gguf_writer *w, const char *key, const char *const *strs,
                               uint64_t n);
/* An array of n elements of a fixed-size type (not STRING / ARRAY); the bytes are copied. */
int st_gguf_writer_set_arr(st_gguf_writer *w, const char *key, uint32_t elem_type,
                           const void *elems, uint64_t n);
int st_gguf_writer_add_tensor(st_gguf_writer *w, const char *name, uint32_t ggml_type,
                              uint32_t n_dims, const uint64_t *dims, const void *data);
int st_gguf_writer_write(st_gguf_writer *w, const char *path);
/* Copy key i of g (any type: strings, arrays of strings, nested arrays) as its serialized bytes.
 * The writer's own general.alignment is set by st_gguf_writer_new: copy it by creating the writer
 * with st_gguf_alignment(g) and skipping the key. */
int st_gguf_writer_copy_kv(st_gguf_writer *w, const st_gguf *g, uint64_t i);
/* A tensor whose bytes are produced during st_gguf_writer_write, one tensor at a time: fill
 * writes exactly nbytes into dst (a buffer the writer owns); a nonzero return (an st_error_set
 * code) aborts the write and nothing is left at the path. */
typedef int (*st_gguf_fill_fn)(void *ctx, uint64_t index, void *dst, uint64_t nbytes);
int st_gguf_writer_add_tensor_fill(st_gguf_writer *w, const char *name, uint32_t ggml_type,
                                   uint32_t n_dims, const uint64_t *dims, st_gguf_fill_fn fill,
                                   void *ctx, uint64_t index);
/* The serialized value of key i (after its type field: a string's u64 length and bytes, an
 * array's element type, count and elements) and its length in bytes. */
int st_gguf_kv_raw(const st_gguf *g, uint64_t i, const void **val, uint64_t *len);

/* ---- quantize -----------------------------------------------------------------------------
 * st_gguf_quantize re-quantizes the GGUF at `in` into `out` (written atomically by the writer
 * above): every tensor llama-quantize would quantize (2-D and 3-D "*.weight" tensors, not
 * norms, ssm_conv1d, ffn_gate_inp, ... ; ggml's dimension count, trailing 1s ignored) becomes
 * `type`, through the weight-type table's quantizer (ggml's bytes), after dequantizing the
 * input through the same table; a row whose length is not a multiple of the type's block falls
 * back as llama.cpp does (Q4_K->Q5_0, Q5_K->Q5_1, Q6_K->Q8_0, Q2_K/Q3_K->Q4_0, IQ4_XS->IQ4_NL,
 * then F16 when 32 does not divide it either). Every other tensor is copied byte for byte, as
 * is a tensor already of its target type. Every key is copied; general.file_type and
 * general.quantization_version are set as llama-quantize sets them; split files are refused.
 * docs/ENGINE.md, "strata quantize". */
typedef struct st_quantize_stats {
    uint64_t n_tensors, n_quantized, n_copied, n_fallback;
    uint64_t bytes_in, bytes_out;
} st_quantize_stats;
typedef struct st_quantize_opts {
    /* called with one line (no newline) per fallback and, when progress is set, per tensor */
    void (*log)(void *ctx, const char *line);
    void *log_ctx;
    int progress; /* also log a line per tensor written */
} st_quantize_opts;
/* ggml's name of a type the quantizer writes ("q4_K", "Q4_K", "iq4_xs", "F16": any case) ->
 * its id; ST_EINVAL naming the types otherwise. */
int st_quantize_type_parse(const char *name, uint32_t *type);
/* "F32, F16, BF16, Q8_0, ..." */
const char *st_quantize_type_list(void);
int st_gguf_quantize(const char *in, const char *out, uint32_t type,
                     const st_quantize_opts *opts /* NULL: silent */, st_quantize_stats *stats);

/* ---- model --------------------------------------------------------------------------------
 * Architecture "strata-hybrid"; docs/ENGINE.md gives the math and the GGUF keys. */
#define ST_ARCH "strata-hybrid"
#define ST_PATTERN_MAX 64

/* Byte-level tokenizer: ids 0..255 are bytes, then these. */
#define ST_TOKEN_BOS 256u
#define ST_TOKEN_EOS 257u
#define ST_TOKEN_SEP 258u /* turn separator */
#define ST_VOCAB_BYTES 259u

typedef struct st_model_hparams {
    uint32_t n_vocab;       /* >= 259: the byte tokenizer's ids */
    uint32_t n_embd;
    uint32_t n_layer;
    uint32_t n_ff;          /* SwiGLU hidden width */
    uint32_t n_ctx;         /* trained context length (the default slot context) */
    uint32_t n_head;        /* attention query heads */
    uint32_t n_head_kv;     /* attention K/V heads (divides n_head) */
    uint32_t head_dim;      /* attention head width (even: RoPE rotates pairs) */
    uint32_t ssm_heads;     /* DeltaNet heads */
    uint32_t ssm_dk;        /* DeltaNet key (and query) width per head */
    uint32_t ssm_dv;        /* DeltaNet value width per head */
    uint32_t ssm_conv;      /* short convolution kernel (4) */
    float rms_eps;
    float rope_base;
    char pattern[ST_PATTERN_MAX]; /* 'D' (DeltaNet) / 'A' (attention), repeated over layers */
    uint32_t kv_dtype;      /* default K/V dtype: ST_DTYPE_F16 or ST_DTYPE_I8 */
    uint32_t wtype;         /* weight type written by st_model_write_seeded: ST_GGML_F32/F16/BF16 */
    char arch[32];          /* general.architecture; "" means strata-hybrid */
    uint32_t tied;          /* llama, qwen3: the LM head is token_embd (no output.weight) */
    uint32_t rope_freqs;    /* llama: rope_freqs.weight divides the RoPE angles */
    /* the Qwen hybrids (ARCHITECTURES.md §2; zero elsewhere) */
    uint32_t n_rot;         /* rotated dimensions per attention head (partial RoPE) */
    uint32_t ssm_groups;    /* DeltaNet key heads Hk (ssm_heads is the value heads Hv) */
    uint32_t n_nextn;       /* trailing MTP blocks in the file (never run, cached or saved) */
    uint32_t ssm_in;        /* qwen3next: 1 for the legacy fused ssm_in (§2.3) */
    int32_t rope_sections[4]; /* qwen35's M-RoPE sections (written; text reduces to NEOX) */
    uint32_t n_expert, n_expert_used; /* qwen3next, qwen35moe: experts, of which top-k per token */
    uint32_t n_ff_exp, n_ff_shexp;    /* an expert's and the shared expert's hidden width */
} st_model_hparams;

/* Fill hp with a named preset: "tiny" (tests), "small" (demo), "bench". ST_EINVAL otherwise. */
int st_model_preset(const char *name, st_model_hparams *hp);
/* The same for an architecture by name (strata-hybrid, llama, qwen3: each names its presets in
 * its ST_EINVAL); an unknown architecture is ST_EINVAL naming the known ones. */
int st_model_preset_arch(const char *arch, const char *name, st_model_hparams *hp);
/* Structural check of hyperparameters (ranges, divisibility, pattern). */
int st_model_hparams_check(const st_model_hparams *hp);
/* 'D' or 'A' for layer il. */
char st_model_layer_kind(const st_model_hparams *hp, uint32_t il);
/* Write a GGUF of hp's architecture with weights drawn from a seeded generator (no meaningful
 * text). */
int st_model_write_seeded(const st_model_hparams *hp, uint64_t seed, const char *name,
                          const char *path);
/* The same model's F32 twin: every weight the value st_model_write_seeded stores in hp->wtype,
 * widened exactly and stored as F32 (what a reference that rounds activations for f16 / bf16
 * weights is run on, docs/MODELS.md). */
int st_model_write_seeded_f32_twin(const st_model_hparams *hp, uint64_t seed, const char *name,
                                   const char *path);
/* Bytes of running state per checkpoint and of K/V per token this geometry implies. */
uint64_t st_model_state_bytes(const st_model_hparams *hp);
uint64_t st_model_kv_bytes_per_token(const st_model_hparams *hp, uint32_t kv_dtype);
uint64_t st_model_n_params(const st_model_hparams *hp);

/* Whether the CUDA backend computes the model of GGUF g: 0 when it does (an architecture of the
 * engine, every tensor of a weight type the engine computes with: strata-hybrid on f32 / f16 /
 * bf16 on its own forward pass, everything else on the GPU's operation table); ST_EINVAL naming
 * the architecture, or the first tensor of another type, when not. The tools and the server
 * choose the CUDA backend when it computes the model and a GPU is there. */
int st_engine_cuda_check(const st_gguf *g);

typedef struct st_model st_model;
/* Load a GGUF model. ST_EINVAL (detail naming it) for an architecture, key, tensor or weight
 * type the engine does not support, and for missing or misshapen tensors; GGUF errors as above. */
int st_model_load(const char *path, st_model **out);
void st_model_free(st_model *m); /* accepts NULL */
const st_model_hparams *st_model_hparams_get(const st_model *m);
/* The architecture's name (general.architecture), static. */
const char *st_model_arch(const st_model *m);
/* Layer il's mixer: 'D' (Gated DeltaNet: keeps a recurrent state) or 'A' (attention: keeps K/V
 * rows per token). */
char st_model_layer_mixer(const st_model *m, uint32_t il);
/* The model's GGUF file (borrowed; valid until st_model_free): its keys and tensors. */
const st_gguf *st_model_gguf(const st_model *m);
/* SHA-256 over the architecture parameters and the tensor data (ST_FINGERPRINT_LEN bytes; its
 * hex: st_hex_encode). */
const uint8_t *st_model_fingerprint(const st_model *m);

/* Tokenizer. Encode writes at most cap ids (returns the count needed); decode writes the bytes
 * of byte tokens (special tokens produce nothing) and returns the count needed. */
size_t st_tokenize(const char *text, size_t len, uint32_t *ids, size_t cap);
size_t st_detokenize(const uint32_t *ids, size_t n, char *dst, size_t cap);

/* ---- vocabulary: the byte-level BPE tokenizer of a GGUF (tokenizer.ggml.model = "gpt2") -----
 * Read from the tokenizer.ggml.* keys (tokens, token_type, merges, pre, the special ids,
 * add_bos_token / add_eos_token) with the pre-tokenizers qwen2, qwen35 and llama-bpe (aliases
 * llama3, llama-v3), as llama.cpp v0.4.0 tokenizes (ARCHITECTURES.md §5, docs/MODELS.md
 * "Tokenizer"); tokenizer.strata.normalizer = "nfc" (written by strata-mkmodel --vocab-from for a
 * tokenizer.json that normalizes, as Qwen's does) normalizes each text fragment to NFC first.
 * Another tokenizer model or pre-tokenizer is ST_EINVAL naming it; a file without
 * tokenizer.ggml.model is ST_ENOTFOUND (strata-hybrid's byte tokenizer above applies). A vocabulary
 * is immutable after loading, owns copies of its texts (the GGUF may be closed), and may be used
 * from any number of threads. */
typedef struct st_vocab st_vocab;
typedef enum st_vocab_pre {
    ST_VOCAB_PRE_NONE = 0,
    ST_VOCAB_PRE_QWEN2,  /* Qwen2, Qwen3, Qwen3-Next: one digit per token */
    ST_VOCAB_PRE_QWEN35, /* Qwen3.5: letter runs take combining marks */
    ST_VOCAB_PRE_LLAMA3, /* Llama 3: digit runs of up to 3; ignore_merges; clean_spaces */
} st_vocab_pre;
/* Token attributes (token_type 1..6, plus the CONTROL llama.cpp forces on end-of-generation and
 * FIM texts such as <|im_end|>, <|endoftext|>, <|eot_id|>). */
#define ST_VOCAB_ATTR_NORMAL 0x01u
#define ST_VOCAB_ATTR_UNKNOWN 0x02u
#define ST_VOCAB_ATTR_CONTROL 0x04u
#define ST_VOCAB_ATTR_USER_DEFINED 0x08u
#define ST_VOCAB_ATTR_UNUSED 0x10u
#define ST_VOCAB_ATTR_BYTE 0x20u
typedef enum st_vocab_id { ST_VOCAB_BOS, ST_VOCAB_EOS, ST_VOCAB_EOT, ST_VOCAB_EOM,
                           ST_VOCAB_PAD } st_vocab_id;
int st_vocab_load(const st_gguf *g, st_vocab **out);
/* The vocabulary alone of a GGUF file (no weights read: also llama.cpp's vocab-only files). */
int st_vocab_open(const char *path, st_vocab **out);
void st_vocab_free(st_vocab *v); /* accepts NULL */
uint32_t st_vocab_n_tokens(const st_vocab *v);
const char *st_vocab_pre_name(const st_vocab *v); /* "qwen2", "qwen35", "llama-bpe", ... */
st_vocab_pre st_vocab_pre_get(const st_vocab *v);
/* A special id, UINT32_MAX when the vocabulary has none (bos and eos default to 11, as in
 * llama.cpp, when the file names none). */
uint32_t st_vocab_special(const st_vocab *v, st_vocab_id which);
int st_vocab_add_bos(const st_vocab *v);
int st_vocab_add_eos(const st_vocab *v);
/* End of generation: the eos / eot / eom ids, the texts llama.cpp stops on (<|im_end|>,
 * <|endoftext|>, <|eot_id|>, <|eom_id|>, <|end_of_text|>, ...) and the FIM pad / repo / file
 * separator tokens. *ids (may be NULL) gets the sorted set, borrowed from v. */
int st_vocab_is_eog(const st_vocab *v, uint32_t id);
uint32_t st_vocab_n_eog(const st_vocab *v, const uint32_t **ids);
unsigned st_vocab_token_attr(const st_vocab *v, uint32_t id); /* 0 beyond the vocabulary */
/* A token's text as the file holds it (byte-level encoded; borrowed), NULL beyond the vocabulary. */
const char *st_vocab_token_text(const st_vocab *v, uint32_t id, size_t *len);
/* The id whose text is exactly text[0..len), or UINT32_MAX. */
uint32_t st_vocab_find(const st_vocab *v, const char *text, size_t len);
/* Tokenize text[0..len) (any bytes: a byte that does not start a complete UTF-8 sequence reads
 * as U+FFFD, as llama.cpp reads it). Special tokens (CONTROL and UNKNOWN when parse_special,
 * USER_DEFINED always) are split out first, longest text first; add_special adds BOS / EOS where
 * the vocabulary says so. Writes at most cap ids (ids may be NULL with cap 0); *n_out gets the
 * count of all of them: call again with a larger buffer when it exceeds cap. Scratch memory is
 * proportional to len. */
int st_vocab_tokenize(const st_vocab *v, const char *text, size_t len, int add_special,
                      int parse_special, uint32_t *ids, size_t cap, size_t *n_out);
/* The bytes of one token (CONTROL / UNKNOWN only when special), *n their count; written when
 * they fit in cap. ST_EINVAL beyond the vocabulary. */
int st_vocab_token_piece(const st_vocab *v, uint32_t id, int special, char *dst, size_t cap,
                         size_t *n);
/* The text of ids (llama.cpp's llama_detokenize: remove_special drops a leading BOS / trailing
 * EOS the vocabulary adds; unparse_special renders CONTROL tokens; llama-bpe cleans spaces
 * before punctuation). Writes min(cap, *n_out) bytes, no NUL. */
int st_vocab_detokenize(const st_vocab *v, const uint32_t *ids, size_t n, int remove_special,
                        int unparse_special, char *dst, size_t cap, size_t *n_out);
/* Streaming: each push writes the token's bytes after the ones held back, less a UTF-8 sequence
 * still incomplete at the end, which it holds (at most 3 bytes) for the next push. cap must take
 * the held bytes and the piece: ST_ETOOBIG otherwise, *n the bytes needed, nothing changed.
 * flush writes what is held (an incomplete sequence at the end of the text) and returns its
 * count (nothing written, held kept, when that exceeds cap). Zero-initialise the stream. */
typedef struct st_vocab_stream {
    uint8_t held[4];
    uint32_t n_held;
} st_vocab_stream;
int st_vocab_stream_push(const st_vocab *v, st_vocab_stream *st, uint32_t id, int special,
                         char *dst, size_t cap, size_t *n);
size_t st_vocab_stream_flush(st_vocab_stream *st, char *dst, size_t cap);

/* The vocabulary of a loaded model (borrowed; valid until st_model_free), NULL for a model of the
 * byte tokenizer (strata-hybrid: st_tokenize / st_detokenize). */
const st_vocab *st_model_vocab(const st_model *m);

/* ---- engine and slots ---------------------------------------------------------------------- */
typedef struct st_engine st_engine;
typedef struct st_slot st_slot;

typedef struct st_engine_opts {
    const char *backend;       /* NULL or "cpu"; "cuda" (docs/ENGINE.md, "CUDA backend") */
    uint32_t n_threads;        /* 0: online CPUs */
    uint32_t ubatch;           /* prompt chunk in tokens (0: 2048) */
    uint32_t n_ctx;            /* 0: the model's */
    uint32_t page_size;        /* K/V tokens per page (0: 256) */
    uint32_t kv_dtype;         /* 0xffffffff: the model's default; ST_DTYPE_F16, ST_DTYPE_I8, or
                                * ST_DTYPE_F32 (cpu backend only) */
    uint32_t prompt_cache;     /* max checkpoints kept per slot (K); 0 disables the cache */
    uint32_t prompt_cache_every; /* checkpoint every N prompt tokens, rounded up to chunks (0 off) */
    uint32_t prompt_cache_root;  /* checkpoint at the end of a system prompt >= N tokens (0 off) */
    int force_scalar;          /* 1: never use the vector kernels (results are identical) */
    int no_avx512;             /* 1: the vector kernels stop at AVX2 (the integer path's AVX-512
                                * VNNI form unused; results are identical) */
    int quant_f32;             /* 1: quantized weights computed in f32 on their dequantized
                                * values (the logits of the file's F32 twin); 0: the integer
                                * path, activations quantized as llama.cpp does, for the types
                                * that have one (docs/ENGINE.md, "The integer path") */
    uint64_t expert_cache_bytes; /* CUDA backend, models with routed experts: 0 keeps every
                                  * expert in VRAM; else the experts stay in host memory (the
                                  * mapped GGUF) with a VRAM arena of this many bytes of whole
                                  * expert records, least recently used out; an arena smaller
                                  * than one token's experts streams them per token (docs/
                                  * ENGINE.md, "The routed-expert cache"). Ignored on the CPU
                                  * backend and for models without experts. */
} st_engine_opts;
/* Defaults: cpu, all CPUs, ubatch 2048, model n_ctx, page 256, model kv dtype, cache 6, every 0,
 * root 0, the integer path (quant_f32 0). */
void st_engine_opts_default(st_engine_opts *o);

int st_engine_new(const st_model *m, const st_engine_opts *o, st_engine **out);
void st_engine_free(st_engine *e); /* accepts NULL; free its slots first */
const st_engine_opts *st_engine_opts_get(const st_engine *e);
const char *st_engine_isa(const st_engine *e); /* "avx2+fma" or "scalar" */
/* The allocation hook of this engine's snapshot images (NULL: ordinary memory), valid for the
 * life of the process: an image read with it (st_file_read_opts.alloc) restores into the engine
 * from memory the engine's images used before (the CPU backend's image buffer cache, the CUDA
 * backend's pinned pool) instead of fresh pages. */
const st_image_allocator *st_engine_image_allocator(const st_engine *e);

/* The BF16 -> FP16 weight-conversion cache of the CUDA backend (docs/ENGINE.md, "The FP16 path
 * for BF16 weights"): STRATA_BF16_TC=1 computes the products on FP16 tensor cores on a card
 * without native BF16 (=2 on any card), converting each weight per call or, with the exact
 * STRATA_BF16_TC_CACHE=1, once into a bounded arena of STRATA_BF16_TC_CACHE_MIB MiB (default
 * 256, 1..65536) per engine. Every field is 0 on the CPU backend and when the path is off. */
typedef struct st_engine_wcache {
    int fp16;                /* the products of BF16 weights run on FP16 tensor cores */
    int cache;               /* the conversion arena is allocated */
    uint64_t arena_bytes;    /* its size (device memory held for it) */
    uint64_t used_bytes;     /* bytes of it the admitted entries span */
    uint64_t entries;        /* weights resident in it */
    uint64_t hits, misses;   /* lookups of immutable weights */
    uint64_t bypassed;       /* misses converted per call (no room: nothing is evicted) */
    uint64_t invalidations;
    uint64_t device_bytes;   /* the backend's device memory at creation, arena included */
} st_engine_wcache;
int st_engine_wcache_get(const st_engine *e, st_engine_wcache *out);
/* Drop every entry of the arena (after the stream is idle); the arena's memory stays with the
 * engine and is filled again from its start. No-op without one. */
int st_engine_wcache_invalidate(st_engine *e);

/* The routed-expert cache of the CUDA backend (st_engine_opts.expert_cache_bytes; docs/ENGINE.md,
 * "The routed-expert cache"). Every field is 0 on the CPU backend, for a model without experts
 * and with every expert in VRAM. Read from any thread: the figures of the last finished call. */
typedef struct st_engine_xcache {
    int host;                /* the routed experts stay in host memory */
    int cached;              /* their VRAM arena exists (0: every token's experts are streamed) */
    uint32_t slots;          /* records the arena holds */
    uint64_t records;        /* expert records of the model (layers x experts) */
    uint64_t record_bytes;   /* bytes of one record (gate, up and down of one layer's expert) */
    uint64_t arena_bytes;    /* device memory of the arena */
    uint64_t hits, misses, evictions;
    uint64_t bytes_uploaded; /* host -> device, arena and streamed */
    uint64_t streamed;       /* calls (a token's experts in one layer) uploaded to the compact
                              * buffer instead of the arena */
    uint64_t load_failures;  /* uploads into the arena that failed (that call streamed) */
} st_engine_xcache;
int st_engine_xcache_get(const st_engine *e, st_engine_xcache *out);

int st_slot_new(st_engine *e, st_slot **out);
void st_slot_free(st_slot *s); /* accepts NULL */
/* Forget the conversation and every checkpoint. */
void st_slot_reset(st_slot *s);

/* The geometry the backend publishes for this slot (borrowed; valid for the slot's life). */
const st_geometry *st_slot_geometry(const st_slot *s);

typedef struct st_eval_stats {
    uint64_t reused;        /* prompt tokens not recomputed (held K/V + running state) */
    uint64_t computed;      /* prompt tokens read */
    uint64_t mounted_at;    /* position of the checkpoint mounted, or of a K/V-only cut
                             * (UINT64_MAX: none) */
    uint32_t checkpoints;   /* checkpoints held afterwards */
} st_eval_stats;

/* Make the slot hold exactly tokens[0..n) and the logits after the last one. The longest prefix
 * it already holds is reused: the live state when it holds a prefix of tokens, otherwise the
 * deepest checkpoint at or before the divergence (K/V cut there), or, for a model whose only
 * running tensor is the position (every layer keeps K/V: llama, qwen3), the held tokens up to the
 * divergence (cut there, at any position; mounted_at says where); the rest is read in chunks
 * whose boundaries are those of a full read. system_len (0: none) marks the end of a system
 * prompt, where a root checkpoint is taken when system_len >= prompt_cache_root. A turn-boundary
 * checkpoint is taken at n. n >= 1. On error the slot is reset (it holds nothing), except
 * ECANCELED: the cancel hook (st_slot_set_cancel) said stop before a chunk, and the slot holds
 * a prefix of tokens: what it reused (its live state, or the checkpoint it mounted, or nothing
 * after a reset) plus the whole chunks read so far, with the logits after the last token read
 * (none when a mounted or reset slot stopped before its first chunk); no checkpoint was taken
 * at the stop. */
int st_slot_eval(st_slot *s, const uint32_t *tokens, uint64_t n, uint64_t system_len,
                 st_eval_stats *stats);
/* A hook st_slot_eval asks before each chunk it reads: nonzero stops the read (ECANCELED). It
 * runs on the thread of the eval, with the engine locked, and must be quick. NULL removes it. */
typedef int (*st_cancel_fn)(void *arg);
void st_slot_set_cancel(st_slot *s, st_cancel_fn fn, void *arg);
/* Append one token (decode). */
int st_slot_decode(st_slot *s, uint32_t token);
uint64_t st_slot_n_tokens(const st_slot *s);
const uint32_t *st_slot_tokens(const st_slot *s);
/* Logits after the last token (n_vocab floats), or NULL when the slot holds none. */
const float *st_slot_logits(const st_slot *s, uint32_t *n);
/* Pick the next token from the logits: temp <= 0 is greedy (lowest id wins ties); otherwise a
 * softmax at temp sampled with a generator keyed by (seed, position), so a conversation split
 * across processes samples the same tokens. */
int st_slot_sample(const st_slot *s, float temp, uint64_t seed, uint32_t *token);
/* Sampling with the usual filters (engine/st_sample.c): top_k (0: off), top_p (1: off) and
 * min_p (0: off) keep candidates by the distribution at temperature 1 (llama.cpp's default
 * order: top-k, top-p, min-p, then the temperature); the softmax at temp over those kept is
 * sampled with st_slot_sample's generator keyed by (seed, position), so the choice is
 * deterministic. The most likely token is always kept; temp <= 0 is greedy. Without a filter the
 * token is st_slot_sample's. ST_EINVAL for top_p outside (0, 1] or min_p outside [0, 1]. */
typedef struct st_sample_params {
    float temp, top_p, min_p;
    uint32_t top_k;
} st_sample_params;
int st_slot_sample_with(const st_slot *s, const st_sample_params *p, uint64_t seed,
                        uint32_t *token);

/* Conversation-cache checkpoints held (positions in increasing order). */
uint32_t st_slot_n_checkpoints(const st_slot *s);
uint64_t st_slot_checkpoint_pos(const st_slot *s, uint32_t i);

/* Hash of the live conversation (tokens, K/V rows, running state), as recorded in images.
 * codec: the running state as it would be after a round trip through that codec. */
int st_slot_state_hash(const st_slot *s, uint32_t codec, uint64_t *out);

/* Snapshot: a session image carries the live state and the deepest other checkpoint (the resume
 * point); a park image carries the whole chain. Running state in codec (fp32 or bf16), K/V in its
 * own dtype, the logits, and the state hash. The slot is not changed. */
#define ST_SNAPSHOT_SESSION 0
#define ST_SNAPSHOT_PARK 1
int st_slot_snapshot(st_slot *s, int mode, uint32_t codec, st_image **out);
/* A prefix image of the conversation for the prefix index (docs/SCALE.md, "The prefix index"):
 * tokens[0..p) and K/V rows [0, p) with the running state after them as the one checkpoint (in
 * codec), taken from the checkpoint held at p, or for a model whose only running tensor is the
 * position (llama, qwen3) made at any p, or the live state when p is n_tokens. It has no logits:
 * a slot restored from it holds the prefix without them, so the next st_slot_eval reads from p
 * (at least one token). ST_ENOTFOUND when the slot holds no running state at p, ST_EINVAL for p
 * outside [1, n_tokens]. The slot is not changed. */
int st_slot_snapshot_prefix(st_slot *s, uint64_t p, uint32_t codec, st_image **out);
/* Restore: the model fingerprint and the geometry are compared first (ST_EMODEL /
 * ST_EGEOMETRY, the detail naming the difference), then the image is checked and loaded into
 * fresh buffers, the state hash is verified (ST_ECORRUPT), and only then swapped in. On any error
 * the slot is exactly as it was. An image without logits (st_slot_snapshot_prefix) leaves the
 * slot holding its tokens without logits. */
int st_slot_restore(st_slot *s, const st_image *img);
/* The same for an image the caller frees next (a session file LOAD, a store RESTORE): the
 * restore may keep the image's fp32 checkpoint blocks as the slot's running state and
 * checkpoints instead of copying them, giving the image the engine's spare buffers in exchange
 * (their bytes are another conversation's). The state hash is verified over the bytes the
 * slot then holds, before anything is exchanged. On success the image's tokens, logits and
 * geometry are as they were but its checkpoints' bytes are not: only free it. On any error the
 * slot and the image are exactly as they were. */
int st_slot_restore_adopt(st_slot *s, st_image *img);

/* ---- conversation cache retention -----------------------------------------------------------
 * One pure function. Entries are the checkpoints held; ticks are a logical clock. With k >= 2
 * the root (the deepest entry flagged root) is pinned and the victim is the least recently used
 * of the others (ties: older creation, then lower position). With k < 2 nothing is pinned and
 * the victim is the first created (FIFO). Returns the index of the entry to evict when n > k,
 * else -1. */
typedef struct st_cache_entry {
    uint64_t position;
    uint64_t created;   /* tick when taken */
    uint64_t last_used; /* tick when taken or last mounted through */
    int root;           /* taken at the end of a system prompt */
} st_cache_entry;
int64_t st_cache_victim(const st_cache_entry *e, size_t n, size_t k);
/* Index of the deepest entry with position <= pos, or -1. */
int64_t st_cache_mount_point(const st_cache_entry *e, size_t n, uint64_t pos);

/* ---- chat templates (st_jinja_parse.c, st_jinja_eval.c, st_chat.c) -------------------------
 * A Jinja interpreter for the chat templates models ship (tokenizer.chat_template), rendering
 * byte for byte what @huggingface/jinja 0.5.11 renders (docs/MODELS.md, "Chat templates"):
 * its defaults (lstrip_blocks and trim_blocks on, one trailing newline of the template
 * dropped), its filters, tests and methods, its printing of none / true / 1.0 and its tojson.
 * Values come from a jansson json_t; a real with an integral value is an integer, as in
 * JavaScript. A parsed template is immutable and may be rendered from several threads. */
typedef struct st_jinja st_jinja;
struct json_t; /* jansson */

/* Bounds of one render; exceeding any is ST_ETOOBIG naming the bound. */
typedef struct st_jinja_limits {
    uint64_t max_iterations; /* loop iterations in all, the items a loop filters included */
    uint32_t max_depth;      /* macro calls and caller() blocks nested */
    size_t max_output;       /* bytes of the output and of any string built on the way */
    size_t max_memory;       /* bytes of working memory of one render */
} st_jinja_limits;
/* 1,000,000 iterations, depth 64, 16 MiB output, 256 MiB memory. */
void st_jinja_limits_default(st_jinja_limits *l);

/* Parse src (len bytes, at most 4 MiB). A syntax error is ST_EINVAL with the detail
 * "line L, column C: what" (column in bytes, both from 1; the position in src as given, before
 * the preprocessing) and, when line / col are not NULL, L and C in them (0 on other errors). */
int st_jinja_parse(const char *src, size_t len, st_jinja **out, uint32_t *line, uint32_t *col);
void st_jinja_free(st_jinja *t); /* accepts NULL */
/* Render with the top-level keys of the object vars as variables (NULL: none). *out is
 * malloc'd, NUL-terminated, *out_len bytes; the caller frees it. A runtime error is ST_EINVAL
 * "line L, column C: what"; raise_exception(msg) is ST_EINVAL "raise_exception: msg". lim NULL:
 * the defaults. */
int st_jinja_render(const st_jinja *t, const struct json_t *vars, const st_jinja_limits *lim,
                    char **out, size_t *out_len);

/* A model's chat template: tokenizer.chat_template parsed, with bos_token / eos_token (the
 * texts of tokenizer.ggml.bos_token_id / eos_token_id, when the file has them). */
typedef struct st_chat_template st_chat_template;
/* ST_ENOTFOUND when the file has no tokenizer.chat_template; a template that does not parse is
 * ST_EINVAL "tokenizer.chat_template: line L, column C: what". */
int st_chat_template_load(const st_gguf *g, st_chat_template **out);
/* ChatML (<|im_start|>ROLE\nCONTENT<|im_end|>\n per message, <|im_start|>assistant\n with
 * add_generation_prompt), the fallback for a model without a usable template; g may be NULL
 * (no bos / eos). */
int st_chat_template_chatml(const st_gguf *g, st_chat_template **out);
void st_chat_template_free(st_chat_template *ct); /* accepts NULL */
/* Render a conversation {"messages": [...], "tools": [...], "add_generation_prompt": bool,
 * "enable_thinking": bool, ...}: its keys become variables, bos_token / eos_token added unless
 * given. Output as st_jinja_render. */
int st_chat_template_render(const st_chat_template *ct, const struct json_t *conversation,
                            char **out, size_t *out_len);

#ifdef __cplusplus
}
#endif
#endif /* ST_ENGINE_H */
