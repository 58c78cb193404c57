//! `send_notification`: sends a user one push notification per message,
//! through the `push` provider, which does not deduplicate (the seed's
//! pattern 5: a non-idempotent provider, fenced, with `on_uncertain`).
//!
//! Grants: `http` for `push`, and `kv` (the example `jobs.toml` runs it on
//! queue `send-notification`, with `on_uncertain = "skip"`).
//! Payload: `{"user_id": 7, "message_id": "m-1", "text": "Your order shipped"}`;
//! `user_id` and `message_id` are non-negative integers or non-empty strings,
//! `text` is non-empty.
//! Result: `{"user_id": 7, "message_id": "m-1", "status": 200, "replayed": false}`;
//! `status` is the provider's HTTP status, and `replayed` is true when the
//! notification had been sent already (by an earlier attempt or an earlier job
//! for the same message) and nothing was sent now.
//!
//! The push is `POST /v1/push` with the JSON body `{"user_id", "text"}` and the
//! idempotency key `notify:<message_id>`: derived from the message, so that
//! redeliveries and duplicate jobs for one message send it once. After a 2xx
//! the handler records `{"user_id", "status"}` in kv under
//! `notified:<message_id>`; writing it again on a replay is harmless. A second
//! job for the same `message_id` with another user or text is refused by the
//! fence as `key-reused` and fails: that message id has been used.
//!
//! # When the outcome is unknown
//!
//! The `push` provider has no `idempotency_header`: it would deliver a repeat
//! twice, so the daemon never sends a request again just because it does not
//! know whether the first one arrived (the daemon died mid-request, the
//! connection broke, the answer timed out). It has no `reconcile` look-up
//! either, so the queue's `on_uncertain` policy decides. With `skip` (the
//! example's, and the default) the fence is marked `uncertain` and the call
//! returns [`EffectError::Uncertain`]; this handler lets `?` turn it into a
//! permanent failure, and the job goes `dead` at once: at most one push, and a
//! person decides about the rest. (`repeat` would send again, so a user may get
//! the notification twice; `dead` dead-letters the job whatever the handler
//! does.) The operator then:
//!
//! 1. lists what needs a decision:
//!    `khata fences --state uncertain --namespace send-notification`
//!    (each fence names its key, `notify:<message_id>`, and its job);
//! 2. finds out from the push provider (its delivery log or dashboard) whether
//!    that notification reached it;
//! 3. says so: `khata fence resolve send-notification http notify:<message_id> done`
//!    if it did, `... not-done` if it did not;
//! 4. runs the job again: `khata retry <job-id>`. After `done` the call replays
//!    a synthetic `204` without sending, and the job completes with `status`
//!    204 and `replayed` true; after `not-done` the push is sent now.
//!
//! Until the fence is resolved, every job for that message id fails with
//! `uncertain` and nothing is sent.
//!
//! A 4xx (the provider refused the push) fails the job; so does a 5xx, which
//! is recorded under the key like any response, so a retry would only replay
//! it (see `charge_customer`'s `settle` for the same reasoning).

use khata_sdk::prelude::*;
use serde::Deserialize;
use serde_json::{Value, json};

/// The payload.
#[derive(Deserialize)]
struct Notification {
    user_id: Value,
    message_id: Value,
    text: String,
}

/// How much of a refusal's body goes into the error message, in characters.
const BODY_EXCERPT_CHARS: usize = 200;

fn handle(job: Job) -> Result<Value, Error> {
    let notification: Notification = job.payload()?;
    let message_id = validate(&notification)?;

    let body = json!({ "user_id": notification.user_id, "text": notification.text });
    let request = http::post("push", "/v1/push").json(&body)?;
    let key = format!("notify:{message_id}");
    // `uncertain` goes through `?` like every other refusal: a permanent
    // failure, for an operator (see the module docs).
    let response = match http::send(&key, request) {
        Ok(response) => response,
        Err(EffectError::KeyReused(reason)) => {
            return Err(Error::fail(format!(
                "message {message_id} was already sent with another user or text \
                 (key {key}): {reason}"
            )));
        }
        Err(e) => return Err(e.into()),
    };
    check_status(&response)?;

    kv::put_json(
        format!("notified:{message_id}"),
        &json!({ "user_id": notification.user_id, "status": response.status }),
    )?;

    Ok(json!({
        "user_id": notification.user_id,
        "message_id": notification.message_id,
        "status": response.status,
        "replayed": response.replayed,
    }))
}

/// Checks the payload; returns the message id as key text.
fn validate(notification: &Notification) -> Result<String, Error> {
    id_text("user_id", &notification.user_id)?;
    let message_id = id_text("message_id", &notification.message_id)?;
    if notification.text.trim().is_empty() {
        return Err(Error::fail("bad payload: text must not be empty"));
    }
    Ok(message_id)
}

/// An id from the payload as key text: a non-empty string as it is, or a
/// non-negative integer in decimal.
fn id_text(field: &str, value: &Value) -> Result<String, Error> {
    match value {
        Value::String(text) if !text.is_empty() => Ok(text.clone()),
        Value::Number(n) if n.is_u64() => Ok(n.to_string()),
        other => Err(Error::fail(format!(
            "bad payload: {field} must be a non-empty string or a non-negative integer, got {other}"
        ))),
    }
}

/// Accepts a 2xx (fresh, replayed, or the `204` of a fence an operator
/// resolved as done); anything else fails the job: the response is recorded
/// under the key, so a retry would get the same one back.
fn check_status(response: &http::Response) -> Result<(), Error> {
    let status = response.status;
    match status {
        200..=299 => Ok(()),
        400..=499 => Err(Error::fail(format!(
            "push refused: {status} {}",
            excerpt(&response.body)
        ))),
        500..=599 => Err(Error::fail(format!(
            "push provider error: {status} (recorded for this message's key, so a retry would \
             replay it; check with the provider before sending under another message id)"
        ))),
        _ => Err(Error::fail(format!(
            "push provider answered an unexpected status: {status}"
        ))),
    }
}

/// The body as text (lossy UTF-8), cut to [`BODY_EXCERPT_CHARS`] characters.
fn excerpt(body: &[u8]) -> String {
    String::from_utf8_lossy(body)
        .trim()
        .chars()
        .take(BODY_EXCERPT_CHARS)
        .collect()
}

khata_sdk::handler!(handle);

#[cfg(test)]
mod tests {
    use super::*;

    fn notification(payload: Value) -> Notification {
        serde_json::from_value(payload).unwrap()
    }

    fn response(status: u16, body: &str) -> http::Response {
        http::Response {
            status,
            headers: Vec::new(),
            body: body.as_bytes().to_vec(),
            replayed: false,
        }
    }

    #[test]
    fn a_valid_payload_yields_the_message_id_as_key_text() {
        let ok = json!({ "user_id": 7, "message_id": 12, "text": "hi" });
        assert_eq!(validate(&notification(ok)).unwrap(), "12");
        let text = json!({ "user_id": "u-7", "message_id": "m-1", "text": "hi" });
        assert_eq!(validate(&notification(text)).unwrap(), "m-1");
    }

    #[test]
    fn bad_payloads_fail() {
        let bad = [
            json!({ "user_id": -7, "message_id": 1, "text": "hi" }),
            json!({ "user_id": 7, "message_id": "", "text": "hi" }),
            json!({ "user_id": 7, "message_id": 1.5, "text": "hi" }),
            json!({ "user_id": 7, "message_id": 1, "text": "  " }),
        ];
        for payload in bad {
            let err = validate(&notification(payload.clone())).unwrap_err();
            assert!(!err.is_retry(), "{payload}");
            assert!(err.message().starts_with("bad payload: "), "{err}");
        }
    }

    #[test]
    fn only_a_2xx_completes() {
        assert!(check_status(&response(200, r#"{"delivered":true}"#)).is_ok());
        assert!(check_status(&response(204, "")).is_ok(), "resolved as done");
        let refused = check_status(&response(410, "no such device")).unwrap_err();
        assert_eq!(refused.message(), "push refused: 410 no such device");
        let failed = check_status(&response(503, "busy")).unwrap_err();
        assert!(!failed.is_retry());
        assert!(failed.message().starts_with("push provider error: 503"));
    }
}
