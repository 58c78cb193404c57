//! `stale`: a test guest that goes on calling effects after its attempt has
//! lost the job, to show that every effect of a stale attempt is refused as
//! `fenced` and changes nothing (docs/fences.md#fencing).
//!
//! | `do` | fields | does |
//! | --- | --- | --- |
//! | `loop` | `rounds` (100000), `pause_ms` (5) | puts `1`, `2`, ... into kv `counter`, one per round with a pause between; after the first put it logs `stale: looping`. At the first put that fails it calls every other effect once (kv get, insert-if-absent, delete; index upsert, remove, get in `docs`; email send; http send to provider `payments`), logs one line `stale-probe <json>` with what each answered, and returns that JSON. `Fail` if every round's put succeeded. |
//! | `read` | | `{"counter": <kv counter as text, or null>, "probe": <kv probe, or null>}` |
//! | `charge` | `order`, `pause_ms` (5) | attempt 1: logs `stale: charging later`, then puts `1`, `2`, ... into kv `tick:<order>` with a pause between until a put fails; then sends the charge anyway and logs one line `stale-charge <json>`, `{"put": <its error>, "http_send": "ok" or the error}`, and returns that JSON. Later attempts send the charge at once and return `{"status": <HTTP status>}`. The charge is `POST /v1/charges` to `payments`, key `stale-charge-<order>`. |
//! | `mail` | `key`, `to` (list), `subject`, `from` (optional), `times` (1) | sends the message `times` times with `key`; `{"ok": <sends answered ok>, "errors": [<each other answer's effect-error name>]}` |
//!
//! The probe line's JSON: `{"last_ok": n, "refused_round": n + 1, "put": "fenced", "kv_get": ..., ...}`,
//! each effect's value being `"ok"` or the effect-error's WIT name.
//!
//! Grants: `kv`, `index = ["docs"]`, `email`, `http = ["payments"]`.

use std::time::Duration;

use khata_sdk::prelude::*;
use serde_json::{Map, Value, json};

fn handle(job: Job) -> Result<Value, Error> {
    let payload: Value = job.payload()?;
    match payload
        .get("do")
        .and_then(Value::as_str)
        .unwrap_or_default()
    {
        "loop" => keep_calling(
            number_or(&payload, "rounds", 100_000),
            number_or(&payload, "pause_ms", 5),
        ),
        "charge" => charge(
            job.attempt(),
            number_or(&payload, "order", 1),
            number_or(&payload, "pause_ms", 5),
        ),
        "read" => {
            Ok(json!({ "counter": text(kv::get("counter")?), "probe": text(kv::get("probe")?) }))
        }
        "mail" => mail(&payload),
        other => Err(Error::fail(format!("unknown \"do\": {other:?}"))),
    }
}

khata_sdk::handler!(handle);

fn keep_calling(rounds: u64, pause_ms: u64) -> Result<Value, Error> {
    let mut last_ok = 0;
    for round in 1..=rounds {
        match kv::put("counter", round.to_string()) {
            Ok(()) => {
                last_ok = round;
                if round == 1 {
                    log::info("stale: looping");
                }
                std::thread::sleep(Duration::from_millis(pause_ms));
            }
            Err(e) => {
                let mut probe = Map::new();
                probe.insert("last_ok".into(), json!(last_ok));
                probe.insert("refused_round".into(), json!(round));
                probe.insert("put".into(), json!(e.kind()));
                probe_the_rest(&mut probe);
                let probe = Value::Object(probe);
                log::info(format!("stale-probe {probe}"));
                return Ok(probe);
            }
        }
    }
    Err(Error::fail(format!(
        "all {rounds} puts succeeded: the attempt never lost its job"
    )))
}

/// See the table above: the first attempt holds its job until it loses it,
/// then tries its effect.
fn charge(attempt: u32, order: u64, pause_ms: u64) -> Result<Value, Error> {
    let key = format!("stale-charge-{order}");
    let request = || {
        http::post("payments", "/v1/charges")
            .header("content-type", "application/json")
            .body(
                format!(r#"{{"order_id":{order},"amount":100,"currency":"EUR","customer":"c"}}"#)
                    .into_bytes(),
            )
    };
    if attempt > 1 {
        let response = http::send(key, request())?;
        return Ok(json!({ "status": response.status }));
    }
    log::info("stale: charging later");
    for round in 1u64.. {
        if let Err(e) = kv::put(format!("tick:{order}"), round.to_string()) {
            let sent = match http::send(key, request()) {
                Ok(_) => "ok",
                Err(e) => e.kind(),
            };
            let probe = json!({ "put": e.kind(), "http_send": sent });
            log::info(format!("stale-charge {probe}"));
            return Ok(probe);
        }
        std::thread::sleep(Duration::from_millis(pause_ms));
    }
    Err(Error::fail("unreachable: the rounds ran out"))
}

/// Calls every other effect once and notes what each answered.
fn probe_the_rest(out: &mut Map<String, Value>) {
    let mut note = |name: &str, result: Result<(), EffectError>| {
        let answer = match result {
            Ok(()) => "ok",
            Err(e) => e.kind(),
        };
        out.insert(name.to_owned(), json!(answer));
    };
    note("kv_get", kv::get("counter").map(drop));
    note(
        "kv_insert_if_absent",
        kv::insert_if_absent("probe", b"1").map(drop),
    );
    note("kv_delete", kv::delete("counter").map(drop));
    note(
        "index_upsert",
        index::upsert("docs", "probe", r#"{"id":"probe"}"#, 1).map(drop),
    );
    note("index_remove", index::remove("docs", "probe", 2).map(drop));
    note("index_get", index::get("docs", "probe").map(drop));
    let message = email::Message::new("stale", "sent by a stale attempt").to("ops@example.com");
    note("email_send", email::send("stale:probe", &message).map(drop));
    let request = http::post("payments", "/v1/charges")
        .header("content-type", "application/json")
        .body(br#"{"order_id":0,"amount":1}"#.to_vec());
    note("http_send", http::send("stale:probe", request).map(drop));
}

/// See the table above.
fn mail(payload: &Value) -> Result<Value, Error> {
    let field = |name: &str| {
        payload
            .get(name)
            .and_then(Value::as_str)
            .unwrap_or_default()
    };
    let mut message = email::Message::new(field("subject"), "a test message");
    for to in payload
        .get("to")
        .and_then(Value::as_array)
        .into_iter()
        .flatten()
    {
        message = message.to(to.as_str().unwrap_or_default());
    }
    if let Some(from) = payload.get("from").and_then(Value::as_str) {
        message = message.from(from);
    }
    let (mut ok, mut errors) = (0, Vec::new());
    for _ in 0..number_or(payload, "times", 1) {
        match email::send(field("key"), &message) {
            Ok(_) => ok += 1,
            Err(e) => errors.push(json!(e.kind())),
        }
    }
    Ok(json!({ "ok": ok, "errors": errors }))
}

fn text(value: Option<Vec<u8>>) -> Value {
    value.map_or(Value::Null, |bytes| {
        json!(String::from_utf8_lossy(&bytes).into_owned())
    })
}

fn number_or(payload: &Value, field: &str, default: u64) -> u64 {
    payload
        .get(field)
        .and_then(Value::as_u64)
        .unwrap_or(default)
}
