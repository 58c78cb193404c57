/*
 * welcome_email_c: sends a new user one welcome email, ever (the seed's
 * pattern 1, the existence check). The twin of the Rust `welcome_email`:
 * same payload, keys, effects and result.
 *
 * Grants: `kv` and `email`.
 * Payload: {"user_id": 7, "email": "ada@example.com", "name": "Ada"}; the
 * user_id is a non-negative integer or a non-empty string.
 * Result: {"user_id": 7, "message_id": "<...@example.com>", "replayed": false};
 * `replayed` is true when the mail had been sent already (by an earlier
 * attempt or an earlier job for the same user) and nothing was sent now.
 *
 * The existence check is the email fence itself: the message is sent with
 * the idempotency key `welcome:<user_id>`, so the host sends it once per user
 * and replays the recorded receipt on any later call. A kv flag checked
 * before sending must not decide the send: a crash between writing the flag
 * and sending would lose the email for good. Only after the send is the
 * Message-ID recorded in kv under `welcomed:<user_id>`; writing it again on
 * a replay is harmless.
 *
 * A second job for the same user with a different message is refused by the
 * fence as key-reused and fails. If the outcome of an earlier send is
 * unknown (the daemon died mid-send), the queue's `on_uncertain` policy
 * decides; with the default `skip` the job fails with `uncertain` for an
 * operator to resolve.
 */
#include <stdlib.h>
#include <string.h>

#include "khata.h"

/* The user id as key text: a non-empty string as it is, or a non-negative
 * integer in decimal. NULL, with `out` a fail, otherwise. */
static char *id_text(const khata_job *job, const char *field, khata_outcome *out) {
    char *json = khata_payload_json(job, field, out);
    if (!json) return NULL;
    uint64_t number;
    char *text = NULL;
    if (json[0] == '"') {
        text = khata_payload_string(job, field, out);
        if (text && !text[0]) {
            free(text);
            text = NULL;
        }
    } else if (khata_payload_u64(job, field, &number, out)) {
        khata_buf b = {0};
        khata_buf_printf(&b, "%llu", (unsigned long long)number);
        text = khata_buf_take(&b);
    }
    if (!text)
        *out = khata_fail("bad payload: %s must be a non-empty string or a non-negative integer, got %s",
                          field, json);
    free(json);
    return text;
}

/* Leading and trailing ASCII whitespace of `text` removed, in place. */
static char *trim(char *text) {
    while (*text == ' ' || *text == '\t' || *text == '\n' || *text == '\r') text++;
    size_t len = strlen(text);
    while (len > 0 && strchr(" \t\n\r", text[len - 1])) text[--len] = '\0';
    return text;
}

khata_outcome khata_handle(const khata_job *job) {
    khata_outcome out;
    char *user_id = id_text(job, "user_id", &out);
    if (!user_id) return out;
    char *email = khata_payload_string(job, "email", &out);
    if (!email) return out;
    char *name_field = khata_payload_string(job, "name", &out);
    if (!name_field) return out;

    /* The message must be the same on every attempt, or the fence would
     * refuse the repeat as key-reused. */
    const char *name = trim(name_field);
    khata_buf subject = {0}, text = {0};
    if (name[0]) {
        khata_buf_printf(&subject, "Welcome, %s!", name);
        khata_buf_printf(&text, "Hello %s,", name);
    } else {
        khata_buf_printf(&subject, "Welcome!");
        khata_buf_printf(&text, "Hello,");
    }
    khata_buf_printf(&text, "\n\nwelcome aboard! Your account is ready, and we are glad to have you.\n");
    const char *to[] = {email, NULL};
    khata_email message = {.to = to, .subject = subject.data, .text = text.data};

    khata_buf key = {0};
    khata_buf_printf(&key, "welcome:%s", user_id);
    khata_receipt receipt;
    khata_effect_error err;
    if (!khata_email_send(key.data, &message, &receipt, &err)) {
        if (err.kind == KHATA_KEY_REUSED)
            return khata_fail("user %s was already welcomed with a different message (key %s): %s", user_id,
                              key.data, err.message);
        return khata_effect_outcome(&err);
    }

    khata_buf flag = {0};
    khata_buf_printf(&flag, "welcomed:%s", user_id);
    if (!khata_kv_put(flag.data, receipt.message_id, strlen(receipt.message_id), &err))
        return khata_effect_outcome(&err);

    char *user_json = khata_payload_json(job, "user_id", &out);
    khata_buf result = {0};
    khata_buf_printf(&result, "{\"user_id\": %s, \"message_id\": ", user_json);
    khata_buf_json_string(&result, receipt.message_id);
    khata_buf_printf(&result, ", \"replayed\": %s}", receipt.replayed ? "true" : "false");
    return khata_ok(khata_buf_take(&result));
}
