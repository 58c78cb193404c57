//! `chaos`: a test guest for the daemon's integration tests. It does what the
//! payload's `"do"` field asks; without one it returns the payload, like `echo`.
//!
//! | `do` | fields | does |
//! | --- | --- | --- |
//! | `echo` | | returns the payload |
//! | `fail` | | `Fail("asked to fail")` |
//! | `retry` | | `Retry("asked to retry")` |
//! | `retry_until` | `n` | retries while `attempt < n`, then `{"attempt": attempt}` |
//! | `trap` | | panics: the guest traps |
//! | `trap_with` | `text` | panics with `text` as its message: the guest traps |
//! | `loop` | | spins forever |
//! | `compute` | `ms` | computes (never calls the host) for `ms` of wall-clock time, then `{"computed": ms}` |
//! | `memory` | | allocates and touches 1 MiB chunks until memory runs out |
//! | `recurse` | | recurses until the stack runs out |
//! | `big_result` | `bytes` | returns a JSON string of `bytes` characters (`bytes + 2` bytes of JSON text) |
//! | `log_flood` | `lines`, `text` (optional) | logs `lines` info lines (`text`, or numbered ones), then `{"lines": lines}` |
//! | `sleep` | `ms` | sleeps (WASI clocks), then `{"slept": ms}` |
//! | `slot` | `slots` (64), `ms` (0) | takes the first free kv slot `slot:<i>`, marks `seen:<i>`, holds it `ms`, frees it; `{"slot": i}`, or `Fail("no free slot")` |
//! | `order` | `tag` | appends `tag` to the kv list `order:<n>`, counted by `order:count`; `{"position": n}` |
//! | `kv_get` | `key` | `{"value": <the kv value as UTF-8, or null>}` |
//! | `exists` | `key` | existence check on `seen:<key>`: first time stores the payload at `data:<key>` and returns `{"new": true}`, then `{"new": false}` |
//! | `print_flood` | `lines` | prints `lines` lines to stdout, then `{"lines": lines}` |
//! | `file` | `path` | tries to read `path`, create `path` and list `/`; `{"read": probe, "create": probe, "list": probe}` |
//! | `env` | `name` | reads the environment: `{"value": <$name or null>, "vars": <count>, "args": <count>}` |
//! | `tcp` | `addr` | tries to connect to `addr` (`host:port`); `{"connect": probe}` |
//! | `resolve` | `host` | tries to resolve `host`; `{"resolve": probe}` |
//!
//! A probe is `{"ok": true, ...}` when the guest got access and
//! `{"ok": false, "error": "<the error it got>"}` when it did not.
//!
//! A missing or mistyped field is `Fail`. Grants: `kv` for `slot`, `order`,
//! `kv_get` and `exists`; the component imports `kv` and `log` (and WASI's
//! filesystem, environment and sockets, which the host links granting
//! nothing).

use std::hint::black_box;
use std::time::Duration;

use khata_sdk::prelude::*;
use serde_json::{Value, json};

fn handle(job: Job) -> Result<Value, Error> {
    let payload: Value = job.payload()?;
    let Some(what) = payload.get("do") else {
        return Ok(payload);
    };
    match what.as_str().unwrap_or_default() {
        "echo" => Ok(payload),
        "fail" => Err(Error::fail("asked to fail")),
        "fail_with" => Err(Error::fail(fail_with(&payload)?)),
        "retry" => Err(Error::retry("asked to retry")),
        "retry_until" => retry_until(&job, number(&payload, "n")?),
        "trap" => panic!("chaos trap"),
        "trap_with" => panic!("{}", text(&payload, "text")?),
        "loop" => spin(),
        "compute" => compute(number(&payload, "ms")?),
        "memory" => exhaust_memory(),
        "recurse" => Ok(json!(recurse(0))),
        "big_result" => Ok(json!("x".repeat(to_usize(number(&payload, "bytes")?)?))),
        "log_flood" => log_flood(
            number(&payload, "lines")?,
            payload.get("text").and_then(Value::as_str),
        ),
        "print_flood" => print_flood(number(&payload, "lines")?),
        "file" => Ok(file(text(&payload, "path")?)),
        "env" => Ok(env(text(&payload, "name")?)),
        "tcp" => Ok(tcp(text(&payload, "addr")?)),
        "resolve" => Ok(resolve(text(&payload, "host")?)),
        "sleep" => sleep(number(&payload, "ms")?),
        "slot" => slot(
            number_or(&payload, "slots", 64)?,
            number_or(&payload, "ms", 0)?,
        ),
        "order" => order(text(&payload, "tag")?),
        "kv_get" => kv_get(text(&payload, "key")?),
        "exists" => exists(text(&payload, "key")?, job.payload_text()),
        other => Err(Error::fail(format!("unknown \"do\": {other}"))),
    }
}

khata_sdk::handler!(handle);

fn retry_until(job: &Job, n: u64) -> Result<Value, Error> {
    let attempt = job.attempt();
    if u64::from(attempt) < n {
        return Err(Error::retry(format!(
            "attempt {attempt} of the {n} asked for"
        )));
    }
    Ok(json!({ "attempt": attempt }))
}

fn spin() -> ! {
    let mut i = 0u64;
    loop {
        i = black_box(i).wrapping_add(1);
    }
}

/// Spins until `ms` have passed. `Instant::now` reads WASI's monotonic
/// clock, a host call; it is read once every few million iterations, so
/// almost all the time is spent in guest code, as a real computation.
fn compute(ms: u64) -> Result<Value, Error> {
    let end = std::time::Instant::now() + Duration::from_millis(ms);
    let mut i = 0u64;
    while std::time::Instant::now() < end {
        for _ in 0..4_000_000 {
            i = black_box(i).wrapping_add(1);
        }
    }
    Ok(json!({ "computed": ms, "spins": black_box(i) > 0 }))
}

fn exhaust_memory() -> ! {
    const MIB: usize = 1 << 20;
    let mut hold: Vec<Vec<u8>> = Vec::new();
    loop {
        let mut chunk = vec![0u8; MIB];
        for page in chunk.chunks_mut(4096) {
            page.fill(0xA5);
        }
        hold.push(black_box(chunk));
    }
}

/// Never returns: the comparison with a value the optimizer cannot see keeps
/// the recursion real, and the addition after the call keeps it out of tail
/// position.
fn recurse(depth: u64) -> u64 {
    let frame = black_box([depth; 8]);
    if frame[0] == black_box(u64::MAX) {
        return depth;
    }
    recurse(frame[1] + 1) + frame[7]
}

fn log_flood(lines: u64, text: Option<&str>) -> Result<Value, Error> {
    for i in 0..lines {
        match text {
            Some(t) => log::info(t),
            None => log::info(format!("chaos log line {i}")),
        }
    }
    Ok(json!({ "lines": lines }))
}

fn print_flood(lines: u64) -> Result<Value, Error> {
    for i in 0..lines {
        println!("chaos stdout line {i}");
    }
    Ok(json!({ "lines": lines }))
}

/// What a sandbox probe got: access (with what it saw) or the error.
fn probe<T>(result: std::io::Result<T>, seen: impl FnOnce(T) -> Value) -> Value {
    match result {
        Ok(v) => json!({ "ok": true, "seen": seen(v) }),
        Err(e) => json!({ "ok": false, "error": e.to_string() }),
    }
}

fn file(path: &str) -> Value {
    let read = probe(std::fs::read(path), |bytes| json!(bytes.len()));
    let create = probe(std::fs::write(path, b"chaos was here"), |()| json!(path));
    let list = probe(std::fs::read_dir("/"), |entries| {
        json!(entries.flatten().count())
    });
    json!({ "read": read, "create": create, "list": list })
}

fn env(name: &str) -> Value {
    json!({
        "value": std::env::var(name).ok(),
        "vars": std::env::vars_os().count(),
        "args": std::env::args_os().count(),
    })
}

fn tcp(addr: &str) -> Value {
    let connect = probe(
        std::net::TcpStream::connect(addr).and_then(|s| s.peer_addr()),
        |peer| json!(peer.to_string()),
    );
    json!({ "connect": connect })
}

fn resolve(host: &str) -> Value {
    use std::net::ToSocketAddrs;
    let resolved = probe((host, 80).to_socket_addrs(), |addrs| {
        json!(addrs.map(|a| a.ip().to_string()).collect::<Vec<_>>())
    });
    json!({ "resolve": resolved })
}

fn sleep(ms: u64) -> Result<Value, Error> {
    std::thread::sleep(Duration::from_millis(ms));
    Ok(json!({ "slept": ms }))
}

/// A concurrency probe: at most one job at a time holds each slot, so the
/// number of distinct slots seen is the concurrency the daemon allowed.
fn slot(slots: u64, ms: u64) -> Result<Value, Error> {
    for i in 0..slots {
        if kv::insert_if_absent(format!("slot:{i}"), b"1")? {
            kv::put(format!("seen:{i}"), b"1")?;
            std::thread::sleep(Duration::from_millis(ms));
            kv::delete(format!("slot:{i}"))?;
            return Ok(json!({ "slot": i }));
        }
    }
    Err(Error::fail("no free slot"))
}

/// Records the order in which jobs ran: `order:<n>` is the tag of the n-th.
fn order(tag: &str) -> Result<Value, Error> {
    let count: u64 = match kv::get("order:count")? {
        None => 0,
        Some(bytes) => String::from_utf8_lossy(&bytes)
            .parse()
            .map_err(|e| Error::fail(format!("order:count is not a number: {e}")))?,
    };
    kv::put(format!("order:{count}"), tag)?;
    kv::put("order:count", (count + 1).to_string())?;
    Ok(json!({ "position": count }))
}

fn kv_get(key: &str) -> Result<Value, Error> {
    let value = kv::get(key)?.map(|bytes| String::from_utf8_lossy(&bytes).into_owned());
    Ok(json!({ "value": value }))
}

/// The existence check (pattern 1): the step runs on the first delivery only.
fn exists(key: &str, payload: &str) -> Result<Value, Error> {
    if kv::insert_if_absent(format!("seen:{key}"), b"1")? {
        kv::put(format!("data:{key}"), payload)?;
        return Ok(json!({ "new": true }));
    }
    Ok(json!({ "new": false }))
}

fn number(payload: &Value, field: &str) -> Result<u64, Error> {
    payload
        .get(field)
        .and_then(Value::as_u64)
        .ok_or_else(|| Error::fail(format!("field \"{field}\" must be a non-negative integer")))
}

fn number_or(payload: &Value, field: &str, default: u64) -> Result<u64, Error> {
    match payload.get(field) {
        None => Ok(default),
        Some(_) => number(payload, field),
    }
}

/// `message` repeated `times` times (default once).
fn fail_with(payload: &Value) -> Result<String, Error> {
    let times = payload.get("times").and_then(Value::as_u64).unwrap_or(1);
    Ok(text(payload, "message")?.repeat(to_usize(times)?))
}

fn text<'a>(payload: &'a Value, field: &str) -> Result<&'a str, Error> {
    payload
        .get(field)
        .and_then(Value::as_str)
        .ok_or_else(|| Error::fail(format!("field \"{field}\" must be a string")))
}

fn to_usize(n: u64) -> Result<usize, Error> {
    usize::try_from(n).map_err(|_| Error::fail(format!("{n} is too large")))
}
