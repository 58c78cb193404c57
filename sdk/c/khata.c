/*
 * khata.c: the C SDK over wit-bindgen's bindings of the world `handler`
 * (handler.h). See khata.h for the contract of each function.
 *
 * Ownership across the boundary (the component model's rules as the
 * bindings apply them): the export's arguments are the callee's, and its
 * result is freed by the bindings after the host copied it, so it must be
 * malloc'd; an import borrows its arguments and hands its results to the
 * caller.
 */
#include "khata.h"

#include <stdio.h>
#include <stdlib.h>
#include <string.h>

/* ---- Outcomes ---- */

static char *vformat(const char *format, va_list args) {
    va_list copy;
    va_copy(copy, args);
    int n = vsnprintf(NULL, 0, format, copy);
    va_end(copy);
    if (n < 0) n = 0;
    char *text = malloc((size_t)n + 1);
    if (!text) abort();
    vsnprintf(text, (size_t)n + 1, format, args);
    return text;
}

static char *copy_text(const char *text) {
    size_t len = strlen(text);
    char *copy = malloc(len + 1);
    if (!copy) abort();
    memcpy(copy, text, len + 1);
    return copy;
}

/* A NUL-terminated copy of a WIT string. */
static char *from_wit(const handler_string_t *s) {
    char *copy = malloc(s->len + 1);
    if (!copy) abort();
    memcpy(copy, s->ptr, s->len);
    copy[s->len] = '\0';
    return copy;
}

khata_outcome khata_ok(char *json) {
    return (khata_outcome){KHATA_OK, json};
}

khata_outcome khata_ok_copy(const char *json) {
    return (khata_outcome){KHATA_OK, copy_text(json)};
}

khata_outcome khata_retry(const char *format, ...) {
    va_list args;
    va_start(args, format);
    char *text = vformat(format, args);
    va_end(args);
    return (khata_outcome){KHATA_RETRY, text};
}

khata_outcome khata_fail(const char *format, ...) {
    va_list args;
    va_start(args, format);
    char *text = vformat(format, args);
    va_end(args);
    return (khata_outcome){KHATA_FAIL, text};
}

/* The export of the world: runs khata_handle on the delivered job. */
bool exports_handler_handle(handler_job_t *job, handler_string_t *ret, handler_job_error_t *err) {
    char *id = from_wit(&job->id);
    char *queue = from_wit(&job->queue);
    char *payload = from_wit(&job->payload);
    khata_job view = {
        .id = id,
        .queue = queue,
        .payload = payload,
        .attempt = job->attempt,
        .max_attempts = job->max_attempts,
        .enqueued_at_ms = job->enqueued_at_ms,
    };
    khata_outcome outcome = khata_handle(&view);
    handler_job_free(job);
    free(id);
    free(queue);
    free(payload);

    char *text = outcome.text ? outcome.text : copy_text(outcome.kind == KHATA_OK ? "null" : "");
    handler_string_t wit = {(uint8_t *)text, strlen(text)};
    switch (outcome.kind) {
    case KHATA_OK:
        *ret = wit;
        return true;
    case KHATA_RETRY:
        err->tag = KHATA_PLUGIN_TYPES_JOB_ERROR_RETRY;
        err->val.retry = wit;
        return false;
    case KHATA_FAIL:
    default:
        err->tag = KHATA_PLUGIN_TYPES_JOB_ERROR_FAIL;
        err->val.fail = wit;
        return false;
    }
}

/* ---- Payload access ---- */

/* A scanner over JSON text. Each skip_* returns the position after what it
 * skipped, or NULL when the text is not JSON there. */
static const char *skip_ws(const char *p) {
    while (*p == ' ' || *p == '\t' || *p == '\n' || *p == '\r') p++;
    return p;
}

static const char *skip_string(const char *p) {
    if (*p != '"') return NULL;
    for (p++; *p; p++) {
        if (*p == '"') return p + 1;
        if (*p == '\\') {
            p++;
            if (!*p) return NULL;
        } else if ((unsigned char)*p < 0x20) {
            return NULL;
        }
    }
    return NULL;
}

static const char *skip_value(const char *p, int depth);

static const char *skip_members(const char *p, char close, int depth) {
    p = skip_ws(p + 1);
    if (*p == close) return p + 1;
    for (;;) {
        if (close == '}') {
            p = skip_string(skip_ws(p));
            if (!p) return NULL;
            p = skip_ws(p);
            if (*p != ':') return NULL;
            p++;
        }
        p = skip_value(p, depth + 1);
        if (!p) return NULL;
        p = skip_ws(p);
        if (*p == close) return p + 1;
        if (*p != ',') return NULL;
        p++;
    }
}

static const char *skip_value(const char *p, int depth) {
    /* The daemon checked the payload; the bound only keeps the stack small. */
    if (depth > 128) return NULL;
    p = skip_ws(p);
    switch (*p) {
    case '"':
        return skip_string(p);
    case '{':
        return skip_members(p, '}', depth);
    case '[':
        return skip_members(p, ']', depth);
    case 't':
        return strncmp(p, "true", 4) == 0 ? p + 4 : NULL;
    case 'f':
        return strncmp(p, "false", 5) == 0 ? p + 5 : NULL;
    case 'n':
        return strncmp(p, "null", 4) == 0 ? p + 4 : NULL;
    default: {
        const char *start = p;
        if (*p == '-') p++;
        while ((*p >= '0' && *p <= '9') || *p == '.' || *p == 'e' || *p == 'E' || *p == '+' || *p == '-') p++;
        return p == start ? NULL : p;
    }
    }
}

static unsigned hex4(const char *p, bool *ok) {
    unsigned v = 0;
    for (int i = 0; i < 4; i++) {
        char c = p[i];
        v <<= 4;
        if (c >= '0' && c <= '9') v |= (unsigned)(c - '0');
        else if (c >= 'a' && c <= 'f') v |= (unsigned)(c - 'a' + 10);
        else if (c >= 'A' && c <= 'F') v |= (unsigned)(c - 'A' + 10);
        else *ok = false;
    }
    return v;
}

static char *put_utf8(char *out, unsigned cp) {
    if (cp < 0x80) {
        *out++ = (char)cp;
    } else if (cp < 0x800) {
        *out++ = (char)(0xC0 | (cp >> 6));
        *out++ = (char)(0x80 | (cp & 0x3F));
    } else if (cp < 0x10000) {
        *out++ = (char)(0xE0 | (cp >> 12));
        *out++ = (char)(0x80 | ((cp >> 6) & 0x3F));
        *out++ = (char)(0x80 | (cp & 0x3F));
    } else {
        *out++ = (char)(0xF0 | (cp >> 18));
        *out++ = (char)(0x80 | ((cp >> 12) & 0x3F));
        *out++ = (char)(0x80 | ((cp >> 6) & 0x3F));
        *out++ = (char)(0x80 | (cp & 0x3F));
    }
    return out;
}

/* The decoded text of the JSON string literal at [start, end), or NULL when
 * an escape is malformed. Decoding never lengthens: each escape is at least
 * as long as the UTF-8 it stands for. */
static char *decode_string(const char *start, const char *end) {
    char *text = malloc((size_t)(end - start) + 1);
    if (!text) abort();
    char *out = text;
    for (const char *p = start + 1; p < end - 1; p++) {
        if (*p != '\\') {
            *out++ = *p;
            continue;
        }
        p++;
        switch (*p) {
        case '"': *out++ = '"'; break;
        case '\\': *out++ = '\\'; break;
        case '/': *out++ = '/'; break;
        case 'b': *out++ = '\b'; break;
        case 'f': *out++ = '\f'; break;
        case 'n': *out++ = '\n'; break;
        case 'r': *out++ = '\r'; break;
        case 't': *out++ = '\t'; break;
        case 'u': {
            bool ok = p + 4 < end;
            unsigned cp = ok ? hex4(p + 1, &ok) : 0;
            p += 4;
            if (ok && cp >= 0xD800 && cp < 0xDC00) {
                ok = p + 6 < end && p[1] == '\\' && p[2] == 'u';
                unsigned low = ok ? hex4(p + 3, &ok) : 0;
                ok = ok && low >= 0xDC00 && low < 0xE000;
                cp = 0x10000 + ((cp - 0xD800) << 10) + (low - 0xDC00);
                p += 6;
            } else if (cp >= 0xDC00 && cp < 0xE000) {
                ok = false;
            }
            if (!ok) {
                free(text);
                return NULL;
            }
            out = put_utf8(out, cp);
            break;
        }
        default:
            free(text);
            return NULL;
        }
    }
    *out = '\0';
    return text;
}

/* The value of member `name` of the top-level object in `json`: true with
 * [*start, *end) the value's text, false when it is absent. Sets *bad when
 * the payload is not a JSON object. */
static bool find_field(const char *json, const char *name, const char **start, const char **end, bool *bad) {
    *bad = false;
    const char *p = skip_ws(json);
    if (*p != '{') {
        *bad = true;
        return false;
    }
    p = skip_ws(p + 1);
    if (*p == '}') return false;
    for (;;) {
        const char *key = skip_ws(p);
        const char *key_end = skip_string(key);
        if (!key_end) break;
        p = skip_ws(key_end);
        if (*p != ':') break;
        const char *value = skip_ws(p + 1);
        const char *value_end = skip_value(value, 1);
        if (!value_end) break;
        char *decoded = decode_string(key, key_end);
        bool match = decoded && strcmp(decoded, name) == 0;
        free(decoded);
        if (match) {
            *start = value;
            *end = value_end;
            return true;
        }
        p = skip_ws(value_end);
        if (*p == '}') return false;
        if (*p != ',') break;
        p++;
    }
    *bad = true;
    return false;
}

/* Finds field `name` or fills `out` with the reason it cannot be read. */
static bool payload_field(const khata_job *job, const char *name, const char **start, const char **end,
                          khata_outcome *out) {
    bool bad;
    if (find_field(job->payload, name, start, end, &bad)) return true;
    *out = bad ? khata_fail("bad payload: not a JSON object") : khata_fail("bad payload: missing field `%s`", name);
    return false;
}

/* The value's text, for a message: cut after 60 bytes. */
static char *shown(const char *start, const char *end) {
    size_t len = (size_t)(end - start);
    bool cut = len > 60;
    if (cut) len = 60;
    char *text = malloc(len + 4);
    if (!text) abort();
    memcpy(text, start, len);
    strcpy(text + len, cut ? "..." : "");
    return text;
}

char *khata_payload_string(const khata_job *job, const char *name, khata_outcome *out) {
    const char *start, *end;
    if (!payload_field(job, name, &start, &end, out)) return NULL;
    char *text = *start == '"' ? decode_string(start, end) : NULL;
    if (!text) {
        char *value = shown(start, end);
        *out = khata_fail("bad payload: %s must be a string, got %s", name, value);
        free(value);
    }
    return text;
}

bool khata_payload_u64(const khata_job *job, const char *name, uint64_t *value, khata_outcome *out) {
    const char *start, *end;
    if (!payload_field(job, name, &start, &end, out)) return false;
    uint64_t v = 0;
    bool ok = start < end && (end - start == 1 || *start != '0');
    for (const char *p = start; ok && p < end; p++) {
        unsigned digit = (unsigned)(*p - '0');
        if (digit > 9 || v > (UINT64_MAX - digit) / 10) ok = false;
        else v = v * 10 + digit;
    }
    if (!ok) {
        char *text = shown(start, end);
        *out = khata_fail("bad payload: %s must be a non-negative integer, got %s", name, text);
        free(text);
        return false;
    }
    *value = v;
    return true;
}

char *khata_payload_json(const khata_job *job, const char *name, khata_outcome *out) {
    const char *start, *end;
    if (!payload_field(job, name, &start, &end, out)) return NULL;
    size_t len = (size_t)(end - start);
    char *text = malloc(len + 1);
    if (!text) abort();
    memcpy(text, start, len);
    text[len] = '\0';
    return text;
}

/* ---- Building JSON ---- */

static void buf_reserve(khata_buf *buf, size_t more) {
    if (buf->len + more + 1 <= buf->cap) return;
    size_t cap = buf->cap ? buf->cap : 64;
    while (cap < buf->len + more + 1) cap *= 2;
    buf->data = realloc(buf->data, cap);
    if (!buf->data) abort();
    buf->cap = cap;
}

void khata_buf_printf(khata_buf *buf, const char *format, ...) {
    va_list args;
    va_start(args, format);
    char *text = vformat(format, args);
    va_end(args);
    size_t len = strlen(text);
    buf_reserve(buf, len);
    memcpy(buf->data + buf->len, text, len + 1);
    buf->len += len;
    free(text);
}

void khata_buf_json_string(khata_buf *buf, const char *text) {
    buf_reserve(buf, strlen(text) * 6 + 2);
    char *out = buf->data + buf->len;
    *out++ = '"';
    for (const unsigned char *p = (const unsigned char *)text; *p; p++) {
        switch (*p) {
        case '"': *out++ = '\\'; *out++ = '"'; break;
        case '\\': *out++ = '\\'; *out++ = '\\'; break;
        case '\n': *out++ = '\\'; *out++ = 'n'; break;
        case '\r': *out++ = '\\'; *out++ = 'r'; break;
        case '\t': *out++ = '\\'; *out++ = 't'; break;
        default:
            if (*p < 0x20) out += sprintf(out, "\\u%04x", *p);
            else *out++ = (char)*p;
        }
    }
    *out++ = '"';
    *out = '\0';
    buf->len = (size_t)(out - buf->data);
}

char *khata_buf_take(khata_buf *buf) {
    char *text = buf->data ? buf->data : copy_text("");
    *buf = (khata_buf){0};
    return text;
}

/* ---- Effects ---- */

const char *khata_effect_kind_name(khata_effect_kind kind) {
    static const char *const names[] = {
        "denied", "key-reused", "in-progress", "fenced", "uncertain", "transient", "rejected", "invalid",
    };
    return (unsigned)kind < sizeof names / sizeof names[0] ? names[kind] : "unknown";
}

khata_outcome khata_effect_outcome(const khata_effect_error *err) {
    const char *kind = khata_effect_kind_name(err->kind);
    const char *message = err->message ? err->message : "";
    bool retry = err->kind == KHATA_IN_PROGRESS || err->kind == KHATA_TRANSIENT || err->kind == KHATA_FENCED;
    return retry ? khata_retry("effect %s: %s", kind, message) : khata_fail("effect %s: %s", kind, message);
}

/* The WIT's effect-error as a khata_effect_error; the tags follow the
 * variant's cases in order, as khata_effect_kind does. */
static void effect_error(khata_plugin_types_effect_error_t *wit, khata_effect_error *err) {
    err->kind = (khata_effect_kind)wit->tag;
    /* Every case carries a string, at the same place. */
    err->message = from_wit(&wit->val.denied);
    khata_plugin_types_effect_error_free(wit);
}

static handler_string_t borrow(const char *text) {
    return (handler_string_t){(uint8_t *)text, strlen(text)};
}

static handler_list_u8_t borrow_bytes(const void *value, size_t len) {
    return (handler_list_u8_t){(uint8_t *)value, len};
}

int khata_kv_get(const char *key, uint8_t **value, size_t *len, khata_effect_error *err) {
    handler_string_t k = borrow(key);
    handler_option_list_u8_t found;
    khata_plugin_types_effect_error_t wit;
    if (!khata_plugin_kv_get(&k, &found, &wit)) {
        effect_error(&wit, err);
        return -1;
    }
    if (!found.is_some) return 0;
    *value = found.val.ptr;
    *len = found.val.len;
    return 1;
}

bool khata_kv_put(const char *key, const void *value, size_t len, khata_effect_error *err) {
    handler_string_t k = borrow(key);
    handler_list_u8_t v = borrow_bytes(value, len);
    khata_plugin_types_effect_error_t wit;
    if (!khata_plugin_kv_put(&k, &v, &wit)) {
        effect_error(&wit, err);
        return false;
    }
    return true;
}

int khata_kv_insert_if_absent(const char *key, const void *value, size_t len, khata_effect_error *err) {
    handler_string_t k = borrow(key);
    handler_list_u8_t v = borrow_bytes(value, len);
    bool inserted;
    khata_plugin_types_effect_error_t wit;
    if (!khata_plugin_kv_insert_if_absent(&k, &v, &inserted, &wit)) {
        effect_error(&wit, err);
        return -1;
    }
    return inserted ? 1 : 0;
}

int khata_kv_delete(const char *key, khata_effect_error *err) {
    handler_string_t k = borrow(key);
    bool deleted;
    khata_plugin_types_effect_error_t wit;
    if (!khata_plugin_kv_delete(&k, &deleted, &wit)) {
        effect_error(&wit, err);
        return -1;
    }
    return deleted ? 1 : 0;
}

/* A WIT list of strings borrowing a NULL-terminated array. */
static handler_list_string_t borrow_list(const char *const *items, handler_string_t *storage, size_t capacity) {
    size_t n = 0;
    for (; items && items[n] && n < capacity; n++) storage[n] = borrow(items[n]);
    return (handler_list_string_t){storage, n};
}

static size_t count(const char *const *items) {
    size_t n = 0;
    while (items && items[n]) n++;
    return n;
}

bool khata_email_send(const char *key, const khata_email *message, khata_receipt *receipt,
                      khata_effect_error *err) {
    size_t to_n = count(message->to), cc_n = count(message->cc);
    handler_string_t *to = calloc(to_n + 1, sizeof *to);
    handler_string_t *cc = calloc(cc_n + 1, sizeof *cc);
    if (!to || !cc) abort();
    khata_plugin_email_message_t m = {
        .to = borrow_list(message->to, to, to_n),
        .cc = borrow_list(message->cc, cc, cc_n),
        .from = {.is_some = message->from != NULL},
        .subject = borrow(message->subject ? message->subject : ""),
        .text = borrow(message->text ? message->text : ""),
        .html = {.is_some = message->html != NULL},
    };
    if (message->from) m.from.val = borrow(message->from);
    if (message->html) m.html.val = borrow(message->html);
    handler_string_t k = borrow(key);
    khata_plugin_email_receipt_t r;
    khata_plugin_types_effect_error_t wit;
    bool ok = khata_plugin_email_send(&k, &m, &r, &wit);
    free(to);
    free(cc);
    if (!ok) {
        effect_error(&wit, err);
        return false;
    }
    receipt->message_id = from_wit(&r.message_id);
    receipt->replayed = r.replayed;
    khata_plugin_email_receipt_free(&r);
    return true;
}

void khata_log(khata_log_level level, const char *format, ...) {
    va_list args;
    va_start(args, format);
    char *text = vformat(format, args);
    va_end(args);
    handler_string_t message = borrow(text);
    khata_plugin_log_log((khata_plugin_log_level_t)level, &message);
    free(text);
}
