//! `welcome_email`: sends a new user one welcome email, ever (the seed's
//! pattern 1, the existence check).
//!
//! Grants: `kv` and `email` (the example `jobs.toml` runs it on queue
//! `welcome-email` in namespace `users`).
//! Payload: `{"user_id": 7, "email": "ada@example.com", "name": "Ada"}`; the
//! `user_id` is a non-negative integer or a non-empty string.
//! Result: `{"user_id": 7, "message_id": "<...@example.com>", "replayed": false}`;
//! `replayed` is true when the mail had been sent already (by an earlier
//! attempt or an earlier job for the same user) and nothing was sent now.
//!
//! The existence check is the email fence itself: the message is sent with the
//! idempotency key `welcome:<user_id>`, so the host sends it once per user and
//! replays the recorded receipt on any later call. A kv flag checked *before*
//! sending (`kv::insert_if_absent("welcome:<user_id>", ..)`) must not decide the
//! send: a crash between writing the flag and sending would lose the email for
//! good. Only after the send is the Message-ID recorded in kv under
//! `welcomed:<user_id>`, for anyone who wants to know whether (and with which
//! message) a user was welcomed; writing it again on a replay is harmless.
//!
//! A second job for the same user with a *different* message (say, the name
//! changed) is refused by the fence as `key-reused` and fails: the user has
//! been welcomed already and is not welcomed twice. If the outcome of an
//! earlier send is unknown (the daemon died mid-send), the queue's
//! `on_uncertain` policy decides; with the default `skip` the job fails with
//! `uncertain` for an operator to resolve.

use khata_sdk::prelude::*;
use serde::Deserialize;
use serde_json::{Value, json};

/// The payload.
#[derive(Deserialize)]
struct Welcome {
    user_id: Value,
    email: String,
    name: String,
}

fn handle(job: Job) -> Result<Value, Error> {
    let welcome: Welcome = job.payload()?;
    let user_id = id_text("user_id", &welcome.user_id)?;

    let key = format!("welcome:{user_id}");
    let receipt = match email::send(&key, &message(&welcome)) {
        Ok(receipt) => receipt,
        Err(EffectError::KeyReused(reason)) => {
            return Err(Error::fail(format!(
                "user {user_id} was already welcomed with a different message \
                 (key {key}): {reason}"
            )));
        }
        Err(e) => return Err(e.into()),
    };

    kv::put(format!("welcomed:{user_id}"), &receipt.message_id)?;

    Ok(json!({
        "user_id": welcome.user_id,
        "message_id": receipt.message_id,
        "replayed": receipt.replayed,
    }))
}

/// The welcome message for `welcome`. It must be the same on every attempt,
/// or the fence would refuse the repeat as `key-reused`.
fn message(welcome: &Welcome) -> email::Message {
    let name = welcome.name.trim();
    let (subject, greeting) = if name.is_empty() {
        ("Welcome!".to_owned(), "Hello,".to_owned())
    } else {
        (format!("Welcome, {name}!"), format!("Hello {name},"))
    };
    let text = format!(
        "{greeting}\n\nwelcome aboard! Your account is ready, and we are glad to have you.\n"
    );
    email::Message::new(subject, text).to(welcome.email.clone())
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

khata_sdk::handler!(handle);

#[cfg(test)]
mod tests {
    use super::*;

    fn welcome(payload: Value) -> Welcome {
        serde_json::from_value(payload).unwrap()
    }

    #[test]
    fn the_message_greets_the_user_by_name() {
        let w = welcome(json!({ "user_id": 7, "email": "ada@example.com", "name": "Ada" }));
        let m = message(&w);
        assert_eq!(m.to, ["ada@example.com"]);
        assert_eq!(m.subject, "Welcome, Ada!");
        assert!(m.text.starts_with("Hello Ada,\n"), "{}", m.text);
        assert_eq!(m.from, None);
        let nameless = welcome(json!({ "user_id": 7, "email": "a@example.com", "name": " " }));
        assert_eq!(message(&nameless).subject, "Welcome!");
    }

    #[test]
    fn user_ids_are_strings_or_non_negative_integers() {
        assert_eq!(id_text("user_id", &json!(7)).unwrap(), "7");
        assert_eq!(id_text("user_id", &json!("u-7")).unwrap(), "u-7");
        for bad in [json!(-1), json!(1.5), json!(""), json!(null), json!([7])] {
            let err = id_text("user_id", &bad).unwrap_err();
            assert!(!err.is_retry());
            assert!(err.message().starts_with("bad payload: user_id"), "{err}");
        }
    }
}
