//! `unstable`: a test guest whose payload picks one way of being unsafe to
//! run twice, for `khata verify` to find.
//!
//! Payload: `{"flaw": "<flaw>", "order_id": 42}`. Every flaw makes one
//! `http` call to provider `payments` (`POST /v1/charges`); they differ in
//! its key and body:
//!
//! | `flaw` | key | body | also |
//! | --- | --- | --- | --- |
//! | `none` | `order-charge-<order_id>` | `{"order_id"}` | |
//! | `clock-key` | `charge-<unix time in ns>` | `{"order_id"}` | |
//! | `random-key` | `charge-<a random u64>` | `{"order_id"}` | |
//! | `changing-body` | `order-charge-<order_id>` | `{"order_id", "at": <unix time in ns>}` | |
//! | `counter-key` | `charge-<n>` | `{"order_id"}` | first reads kv `charges` (0 when absent), puts `n` = that + 1 |
//!
//! Result: `{"flaw": "<flaw>"}`, whatever the response (so that the result
//! itself is stable). Grants: `http = ["payments"]`, and `kv` for
//! `counter-key`.

use std::collections::hash_map::RandomState;
use std::hash::{BuildHasher, Hasher};
use std::time::{SystemTime, UNIX_EPOCH};

use khata_sdk::prelude::*;
use serde::Deserialize;
use serde_json::{Value, json};

#[derive(Deserialize)]
struct Payload {
    flaw: String,
    #[serde(default)]
    order_id: u64,
}

fn now_ns() -> u128 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map_or(0, |d| d.as_nanos())
}

/// A number from the host's random source (WASI `random`), through the
/// random keys of std's hasher.
fn random() -> u64 {
    let mut h = RandomState::new().build_hasher();
    h.write_u8(0);
    h.finish()
}

fn handle(job: Job) -> Result<Value, Error> {
    let p: Payload = job.payload()?;
    let order = p.order_id;
    let (key, body) = match p.flaw.as_str() {
        "none" => (
            format!("order-charge-{order}"),
            json!({ "order_id": order }),
        ),
        "clock-key" => (format!("charge-{}", now_ns()), json!({ "order_id": order })),
        "random-key" => (format!("charge-{}", random()), json!({ "order_id": order })),
        "changing-body" => (
            format!("order-charge-{order}"),
            json!({ "order_id": order, "at": now_ns().to_string() }),
        ),
        "counter-key" => {
            let n = kv::get_json::<u64>("charges")?.unwrap_or(0) + 1;
            kv::put_json("charges", &n)?;
            (format!("charge-{n}"), json!({ "order_id": order }))
        }
        other => return Err(Error::fail(format!("unknown flaw {other:?}"))),
    };
    http::send(key, http::post("payments", "/v1/charges").json(&body)?)?;
    Ok(json!({ "flaw": p.flaw }))
}

khata_sdk::handler!(handle);
