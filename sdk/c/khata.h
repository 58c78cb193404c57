/*
 * khata.h: write khata job handlers in C.
 *
 * A handler defines one function,
 *
 *     khata_outcome khata_handle(const khata_job *job);
 *
 * and is built with `khata-build-c handler.c -o handler.wasm` (see
 * docs/handlers/c.md). It runs inside a WebAssembly sandbox and reaches the
 * world only through the effect functions below, each a host function of the
 * daemon, checked against the queue's grants.
 *
 * Delivery is at least once: any line may run more than once. External
 * effects (khata_email_send) take an idempotency key that names the effect,
 * such as "welcome:7": the host performs the effect once per key and replays
 * the recorded result (receipt.replayed) afterwards. Build keys from the
 * business object, never from the time or randomness.
 *
 * Errors: a function that can fail returns false (or NULL, or -1) and fills
 * the khata_outcome or khata_effect_error its caller passed, so that a
 * handler returns it as it is:
 *
 *     khata_outcome out;
 *     char *email = khata_payload_string(job, "email", &out);
 *     if (!email) return out;   // fail: "bad payload: missing field `email`"
 *
 * Memory: every char * a function here returns is the caller's, to free()
 * (an attempt's memory goes with its instance, so a handler may also leave
 * it). Strings are UTF-8 and NUL-terminated.
 *
 * The generated bindings (handler.h, included below) stay available for
 * what this header does not wrap: the index and http interfaces.
 */
#ifndef KHATA_H
#define KHATA_H

#include <stdarg.h>
#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#include "handler.h"

/* One delivery of a job. `id` is stable across every retry. */
typedef struct khata_job {
    const char *id;
    const char *queue;
    /* The JSON text that was enqueued. */
    const char *payload;
    /* 1 on the first delivery. */
    uint32_t attempt;
    uint32_t max_attempts;
    uint64_t enqueued_at_ms;
} khata_job;

typedef enum khata_outcome_kind {
    /* Completed: `text` is the result, JSON text. */
    KHATA_OK,
    /* Transient: back off and deliver the job again. */
    KHATA_RETRY,
    /* Permanent: dead-letter the job now. */
    KHATA_FAIL,
} khata_outcome_kind;

/* What an attempt ends with; `text` is malloc'd and owned by the outcome. */
typedef struct khata_outcome {
    khata_outcome_kind kind;
    char *text;
} khata_outcome;

/* The handler; every khata C plugin defines it. */
khata_outcome khata_handle(const khata_job *job);

/* Completed with `json` (JSON text) as the result; takes ownership of a
 * malloc'd string. */
khata_outcome khata_ok(char *json);
/* Completed with a copy of `json`. */
khata_outcome khata_ok_copy(const char *json);
/* Retry later; the message is formatted as by printf. */
khata_outcome khata_retry(const char *format, ...) __attribute__((format(printf, 1, 2)));
/* Fail for good; the message is formatted as by printf. */
khata_outcome khata_fail(const char *format, ...) __attribute__((format(printf, 1, 2)));

/* ---- Payload access: fields of the payload's top-level JSON object ---- */

/* Field `name` as a string (escapes decoded). NULL, with `out` a fail
 * naming the field, when it is missing or not a string. */
char *khata_payload_string(const khata_job *job, const char *name, khata_outcome *out);
/* Field `name` as a non-negative integer. False, with `out` a fail naming
 * the field, when it is missing or not an integer in 0..2^64-1. */
bool khata_payload_u64(const khata_job *job, const char *name, uint64_t *value, khata_outcome *out);
/* Field `name`'s value as JSON text, as it was enqueued (say `7` or
 * `"u-7"`). NULL, with `out` a fail, when the field is missing. */
char *khata_payload_json(const khata_job *job, const char *name, khata_outcome *out);

/* ---- Building JSON text (results, request bodies) ---- */

/* A growing string; start with `khata_buf b = {0};`. */
typedef struct khata_buf {
    char *data;
    size_t len;
    size_t cap;
} khata_buf;

/* Appends formatted text. */
void khata_buf_printf(khata_buf *buf, const char *format, ...) __attribute__((format(printf, 2, 3)));
/* Appends `text` as a JSON string literal, quoted and escaped. */
void khata_buf_json_string(khata_buf *buf, const char *text);
/* The text built so far, NUL-terminated, handed over to the caller (the
 * buffer is empty again). */
char *khata_buf_take(khata_buf *buf);

/* ---- Effects ---- */

/* Why the host did not perform an effect (the WIT's effect-error). */
typedef enum khata_effect_kind {
    /* Not granted to this queue. */
    KHATA_DENIED,
    /* The key was done before with another request. */
    KHATA_KEY_REUSED,
    /* A live attempt holds this fence. */
    KHATA_IN_PROGRESS,
    /* This attempt no longer holds the job's lease. */
    KHATA_FENCED,
    /* The outcome of an earlier try is unknown; the queue's policy is skip. */
    KHATA_UNCERTAIN,
    /* The provider failed; safe to retry. */
    KHATA_TRANSIENT,
    /* The provider refused; retrying won't help. */
    KHATA_REJECTED,
    /* The request itself is malformed. */
    KHATA_INVALID,
} khata_effect_kind;

typedef struct khata_effect_error {
    khata_effect_kind kind;
    /* The host's explanation (malloc'd). */
    char *message;
} khata_effect_error;

/* The WIT name of the kind, such as "key-reused". */
const char *khata_effect_kind_name(khata_effect_kind kind);
/* The outcome an effect error gives when a handler does not handle it, as
 * in the Rust SDK: retry for in-progress, transient and fenced (another
 * attempt can succeed), fail for the others; the message is
 * "effect KIND: MESSAGE". */
khata_outcome khata_effect_outcome(const khata_effect_error *err);

/* kv: key-value data in the queue's namespace. Each call is one atomic step. */

/* The value under `key`: 1 and a malloc'd copy in *value (its length in
 * *len) when present, 0 when absent, -1 on an error. */
int khata_kv_get(const char *key, uint8_t **value, size_t *len, khata_effect_error *err);
/* Writes `len` bytes under `key`. */
bool khata_kv_put(const char *key, const void *value, size_t len, khata_effect_error *err);
/* The existence check: 1 when the value was inserted, 0 when the key
 * already existed (nothing written), -1 on an error. */
int khata_kv_insert_if_absent(const char *key, const void *value, size_t len, khata_effect_error *err);
/* 1 when a value was deleted, 0 when there was none, -1 on an error. */
int khata_kv_delete(const char *key, khata_effect_error *err);

/* email: one message per idempotency key. */

typedef struct khata_email {
    /* Recipients, each list ended by NULL; `cc` may be NULL. */
    const char *const *to;
    const char *const *cc;
    /* NULL: the daemon's configured sender. */
    const char *from;
    const char *subject;
    const char *text;
    /* NULL: text only. */
    const char *html;
} khata_email;

typedef struct khata_receipt {
    /* The Message-ID (malloc'd). */
    char *message_id;
    /* True when this key was sent before and nothing was sent now. */
    bool replayed;
} khata_receipt;

/* Sends `message` once for `key`. The message must be the same on every
 * attempt: another message under a key already sent is refused as
 * KHATA_KEY_REUSED. */
bool khata_email_send(const char *key, const khata_email *message, khata_receipt *receipt,
                      khata_effect_error *err);

/* log: lines into the daemon's log, tagged with the job and attempt. */

typedef enum khata_log_level {
    KHATA_TRACE,
    KHATA_DEBUG,
    KHATA_INFO,
    KHATA_WARN,
    KHATA_ERROR,
} khata_log_level;

/* Logs a line formatted as by printf. */
void khata_log(khata_log_level level, const char *format, ...) __attribute__((format(printf, 2, 3)));

#endif
