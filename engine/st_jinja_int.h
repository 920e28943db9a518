/*
 * st_jinja_int.h - the chat-template interpreter's inside: the arena, the syntax tree, the
 * helpers the evaluator shares with the parser.
 *
 * Dependencies point one way: st_jinja_parse.c (preprocessing, lexer, parser) knows nothing of
 * evaluation; st_jinja_eval.c walks the tree the parser built and uses the arena and the
 * text helpers below, which live in st_jinja_parse.c.
 *
 * The language and its quirks are those of @huggingface/jinja 0.5.11 (the reference the tests
 * compare with, byte for byte): its preprocessing (lstrip_blocks, trim_blocks, one trailing
 * newline dropped), its lexer and its grammar, not Python Jinja's where they differ.
 */
#ifndef ST_JINJA_INT_H
#define ST_JINJA_INT_H

#include <stddef.h>
#include <stdint.h>

/* ---- arena: everything of one parse or one render, freed at once; a cap on the total ---- */
typedef struct st_jblk st_jblk;
typedef struct st_jarena {
    st_jblk *head;
    size_t used;  /* bytes handed out, blocks' headers included */
    size_t cap;   /* the most it may hand out; 0: unlimited */
} st_jarena;

/* NULL when the cap would be passed (or malloc fails); memory is zeroed. */
void *st_jarena_alloc(st_jarena *a, size_t n);
void st_jarena_free(st_jarena *a);

/* JavaScript's \s (the set String.prototype.trim strips): the length in bytes of the
 * whitespace character starting at p (0 when none), and of the one ending at p. */
size_t st_jinja_space_at(const char *p, const char *end);
size_t st_jinja_space_before(const char *start, const char *p);

/* ---- the syntax tree ---------------------------------------------------------------------- */
enum {
    JN_STR = 1,  /* string literal or template text: s, n */
    JN_INT,      /* i */
    JN_FLOAT,    /* f */
    JN_IDENT,    /* s, n */
    JN_ARRAY,    /* list */
    JN_TUPLE,    /* list */
    JN_OBJECT,   /* list: key, value, key, value ... */
    JN_MEMBER,   /* a object, b property (JN_SLICE when sliced), flag: computed ([]) */
    JN_SLICE,    /* a start, b stop, c step (each may be NULL) */
    JN_CALL,     /* a callee, list arguments */
    JN_KWARG,    /* s, n name, a value */
    JN_SPREAD,   /* *a */
    JN_KWSPREAD, /* **a */
    JN_BINARY,   /* op, a, b */
    JN_UNARY,    /* op, a */
    JN_FILTER,   /* a operand, b filter (JN_IDENT or JN_CALL) */
    JN_TEST,     /* a operand, s, n test name, flag: negated */
    JN_SELECT,   /* a if b (no else) */
    JN_TERNARY,  /* a condition, b if true, c if false */
    JN_IF,       /* a test, list body, list2 alternate */
    JN_FOR,      /* a loop variable, b iterable, list body, list2 else */
    JN_SET,      /* a assignee, b value (NULL: block set, list body) */
    JN_MACRO,    /* s, n name, list2 parameters, list body */
    JN_CALLBLK,  /* a call expression, list2 caller parameters, list body */
    JN_FILTERBLK,/* b filter, list body */
    JN_BREAK,
    JN_CONTINUE,
    JN_COMMENT,
};

enum {
    JOP_AND = 1, JOP_OR, JOP_NOT, JOP_IN, JOP_NOTIN, JOP_EQ, JOP_NE, JOP_LT, JOP_GT, JOP_LE,
    JOP_GE, JOP_ADD, JOP_SUB, JOP_CONCAT, JOP_MUL, JOP_DIV, JOP_FLOORDIV, JOP_MOD, JOP_POW,
};

typedef struct st_jnode st_jnode;
struct st_jnode {
    uint8_t kind;
    uint8_t op;
    uint8_t flag;
    uint32_t pos;   /* byte offset in the original template source */
    const char *s;
    size_t n;
    int64_t i;
    double f;
    st_jnode *a, *b, *c;
    st_jnode **list;
    uint32_t nlist;
    st_jnode **list2;
    uint32_t nlist2;
};

/* A parsed template: the program's statements, and the source for line / column reports. */
struct st_jinja {
    st_jarena arena;
    st_jnode **body;
    uint32_t nbody;
    char *src;      /* the original text (NUL-terminated copy): for line / column */
    size_t src_len;
    char *pre;      /* the preprocessed text, which text and identifier nodes point into */
};

/* Line and column (both from 1, the column in bytes) of offset pos in src. */
void st_jinja_linecol(const char *src, size_t len, size_t pos, uint32_t *line, uint32_t *col);

#endif
