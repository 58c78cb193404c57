//! `charge_customer`: charges a customer for an order once, through the
//! `payments` provider (the seed's pattern 3, a provider idempotency key).
//!
//! Grants: `http` for `payments`.
//! Payload: `{"order_id": 42, "amount": 1200, "currency": "eur", "customer": "cus_1"}`;
//! `order_id` is a non-negative integer or a non-empty string, `amount` a
//! positive integer in the currency's minor unit (cents), `currency` a
//! three-letter code, `customer` the provider's non-empty customer id.
//! Result: `{"order_id": 42, "status": 201, "charge": {...}, "replayed": false}`;
//! `status` is the provider's HTTP status, `charge` its response body as JSON
//! (null when the body is empty or not JSON), and `replayed` is true when the
//! charge had been made already and its recorded response was returned.
//!
//! The charge is `POST /v1/charges` with the JSON body
//! `{"order_id", "amount", "currency", "customer"}` and the idempotency key
//! `order-charge-<order_id>`: derived from the order, not from the job or the
//! attempt, so that redeliveries and duplicate jobs for one order charge once.
//! The daemon sends the key in the provider's idempotency header and records
//! the response; a repeat replays it.
//!
//! A payload that fails validation, a 4xx (the provider refused the charge) and
//! a 5xx (the provider failed; see [`settle`] for why that is not retried) all
//! fail the job for a person to look at.

use khata_sdk::prelude::*;
use serde::Deserialize;
use serde_json::{Value, json};

/// The payload.
#[derive(Deserialize)]
struct Charge {
    order_id: Value,
    amount: i64,
    currency: String,
    customer: String,
}

/// How much of a refusal's body goes into the error message, in characters.
const BODY_EXCERPT_CHARS: usize = 200;

fn handle(job: Job) -> Result<Value, Error> {
    let charge: Charge = job.payload()?;
    let order_id = validate(&charge)?;

    let body = json!({
        "order_id": charge.order_id,
        "amount": charge.amount,
        "currency": charge.currency,
        "customer": charge.customer,
    });
    let request = http::post("payments", "/v1/charges").json(&body)?;
    let response = http::send(format!("order-charge-{order_id}"), request)?;
    settle(&charge.order_id, &response)
}

/// Checks the payload; returns the order id as key text.
fn validate(charge: &Charge) -> Result<String, Error> {
    let order_id = match &charge.order_id {
        Value::String(text) if !text.is_empty() => text.clone(),
        Value::Number(n) if n.is_u64() => n.to_string(),
        other => {
            return Err(Error::fail(format!(
                "bad payload: order_id must be a non-empty string or a non-negative integer, \
                 got {other}"
            )));
        }
    };
    if charge.amount <= 0 {
        return Err(Error::fail(format!(
            "bad payload: amount must be positive, got {}",
            charge.amount
        )));
    }
    if !(charge.currency.len() == 3 && charge.currency.chars().all(|c| c.is_ascii_alphabetic())) {
        return Err(Error::fail(format!(
            "bad payload: currency must be a three-letter code, got {:?}",
            charge.currency
        )));
    }
    if charge.customer.is_empty() {
        return Err(Error::fail("bad payload: customer must not be empty"));
    }
    Ok(order_id)
}

/// Turns the provider's response (fresh or replayed) into the job's outcome.
fn settle(order_id: &Value, response: &http::Response) -> Result<Value, Error> {
    let status = response.status;
    match status {
        200..=299 => {
            let charge = serde_json::from_slice::<Value>(&response.body).unwrap_or(Value::Null);
            Ok(json!({
                "order_id": order_id,
                "status": status,
                "charge": charge,
                "replayed": response.replayed,
            }))
        }
        400..=499 => Err(Error::fail(format!(
            "payment refused: {status} {}",
            excerpt(&response.body)
        ))),
        // A 5xx would naturally be `Error::Retry("payment provider error: ..")`,
        // but the charge is a fenced effect: the daemon recorded this 5xx under
        // the key (as Stripe records a 500 under its idempotency key), and every
        // retry with the same key replays the same 5xx without reaching the
        // provider, so retries would only use up the attempts and then
        // dead-letter anyway. Getting past it needs a new key (a new job that
        // charges under another key) or an operator who has checked with the
        // provider whether the money moved: a 5xx does not say it did not, and
        // charging under a new key after a charge that did go through charges
        // the customer twice. So fail now, and dead-letter the job for a person.
        500..=599 => Err(Error::fail(format!(
            "payment provider error: {status} (recorded for this order's key, so a retry would \
             replay it; check with the provider before charging again)"
        ))),
        _ => Err(Error::fail(format!(
            "payment provider answered an unexpected status: {status}"
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

    fn charge(payload: Value) -> Charge {
        serde_json::from_value(payload).unwrap()
    }

    fn response(status: u16, body: &str, replayed: bool) -> http::Response {
        http::Response {
            status,
            headers: Vec::new(),
            body: body.as_bytes().to_vec(),
            replayed,
        }
    }

    #[test]
    fn a_valid_payload_yields_the_order_id_as_key_text() {
        let ok = json!({ "order_id": 42, "amount": 1200, "currency": "eur", "customer": "c" });
        assert_eq!(validate(&charge(ok)).unwrap(), "42");
        let text = json!({ "order_id": "o-1", "amount": 1, "currency": "USD", "customer": "c" });
        assert_eq!(validate(&charge(text)).unwrap(), "o-1");
    }

    #[test]
    fn bad_payloads_fail() {
        let bad = [
            json!({ "order_id": 42, "amount": 0, "currency": "eur", "customer": "c" }),
            json!({ "order_id": 42, "amount": -5, "currency": "eur", "customer": "c" }),
            json!({ "order_id": 42, "amount": 5, "currency": "euro", "customer": "c" }),
            json!({ "order_id": 42, "amount": 5, "currency": "e1r", "customer": "c" }),
            json!({ "order_id": 42, "amount": 5, "currency": "", "customer": "c" }),
            json!({ "order_id": "", "amount": 5, "currency": "eur", "customer": "c" }),
            json!({ "order_id": -1, "amount": 5, "currency": "eur", "customer": "c" }),
            json!({ "order_id": 42, "amount": 5, "currency": "eur", "customer": "" }),
        ];
        for payload in bad {
            let err = validate(&charge(payload.clone())).unwrap_err();
            assert!(!err.is_retry(), "{payload}");
            assert!(err.message().starts_with("bad payload: "), "{err}");
        }
    }

    #[test]
    fn a_2xx_completes_with_the_charge() {
        let done = settle(&json!(42), &response(201, r#"{"id":"ch_1"}"#, true)).unwrap();
        assert_eq!(
            done,
            json!({ "order_id": 42, "status": 201, "charge": { "id": "ch_1" }, "replayed": true })
        );
        let empty = settle(&json!("o-1"), &response(204, "", false)).unwrap();
        assert_eq!(empty["charge"], Value::Null);
        assert_eq!(empty["replayed"], false);
    }

    #[test]
    fn a_4xx_fails_with_the_start_of_the_body() {
        let body = format!("card declined {}", "x".repeat(500));
        let err = settle(&json!(42), &response(402, &body, false)).unwrap_err();
        assert!(!err.is_retry());
        let expected = format!("payment refused: 402 {}", &body[..200]);
        assert_eq!(err.message(), expected);
    }

    #[test]
    fn a_5xx_fails_rather_than_retrying_a_replay() {
        let err = settle(&json!(42), &response(503, "busy", false)).unwrap_err();
        assert!(!err.is_retry());
        assert!(
            err.message().starts_with("payment provider error: 503"),
            "{err}"
        );
    }
}
