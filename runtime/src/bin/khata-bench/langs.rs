//! Figure 9, handler languages: Rust, Python (componentize-py) and
//! JavaScript (componentize-js) side by side, each from the guests that
//! `scripts/build-plugins` builds:
//!
//! - the size of each `echo` twin (`echo`, `echo_py`, `echo_js`);
//! - its compile time in this process, cold (a fresh code cache: compiled)
//!   and warm (a second `Host` on the same cache directory: read back, as
//!   the daemon does on a restart or a re-added file);
//! - one invocation (instantiate, call, drop) as figure 4 measures it;
//! - jobs/s of the twin through the daemon, [`LANG_JOBS`] due at once,
//!   concurrency 16, counted once the daemon serves the plugin (its compile
//!   is not in the rate);
//! - jobs/s of the example plugins against their Rust twins:
//!   `welcome_email_py` over SMTP to the aiosmtpd sink, `charge_customer_js`
//!   over HTTP to the payments server, as figure 7 runs them.

use std::time::Instant;

use anyhow::{Context, ensure};

use khata::host::{CodeSource, Host, PoolSize};

use super::{
    Bench, Daemon, InvocationBed, PaymentsServer, RUNS, Row, SmtpSink, Spread, WELCOME_QUEUE,
    charge_payload, drain_rate, echo_payload, note, sha256_hex, thousands, wait_serving,
    welcome_payload,
};

/// The languages and their `echo` twins.
const LANGS: [(&str, &str); 3] = [("Rust", "echo"), ("Python", "echo_py"), ("JS", "echo_js")];
/// Jobs drained per run of the jobs/s figures.
const LANG_JOBS: usize = 2_000;
/// Invocations timed per language, after [`LANG_WARM_UP`] untimed ones.
const LANG_INVOCATIONS: usize = 500;
const LANG_WARM_UP: usize = 20;
/// Compilations per language, each into a fresh cache (cold) and then read
/// back from it (warm).
const COMPILES: usize = 3;
/// The linear memory each instance may use: enough for an interpreter.
const MEMORY: u64 = 128 << 20;

pub(super) async fn figure_languages(bench: &Bench) -> anyhow::Result<Vec<Row>> {
    let guests = [
        "echo",
        "echo_py",
        "echo_js",
        "welcome_email",
        "welcome_email_py",
        "charge_customer",
        "charge_customer_js",
    ];
    for guest in guests {
        let path = bench.plugins.join(format!("{guest}.wasm"));
        ensure!(
            path.is_file(),
            "{} is missing: build the guests with scripts/build-plugins",
            path.display()
        );
    }
    let mut sizes = Vec::new();
    let mut cold = Vec::new();
    let mut warm = Vec::new();
    let mut calls = Vec::new();
    let mut rates = Vec::new();
    for (lang, guest) in LANGS {
        let bytes = std::fs::read(bench.plugins.join(format!("{guest}.wasm")))
            .with_context(|| format!("reading {guest}.wasm"))?;
        sizes.push(format!("{lang} {:.1} MB", bytes.len() as f64 / 1e6));

        let (c, w) = compile_times(bench, guest, &bytes)?;
        note(format!("9: {lang}: compile cold {c} s, warm {w} s"));
        cold.push(format!("{lang} {c}"));
        warm.push(format!("{lang} {w}"));

        let micros = invocation_micros(bench, guest).await?;
        note(format!("9: {lang}: one invocation {micros:.0} µs"));
        calls.push(format!("{lang} {micros:.0} µs"));

        let queue = format!("[queues.q]\nplugin = \"{guest}\"\nconcurrency = 16\n");
        let spread = drains_once_serving(bench, &queue, "q", guest, &bytes, echo_payload).await?;
        note(format!("9: {lang}: {guest} {spread} jobs/s"));
        rates.push(format!("{lang} {spread}"));
    }

    let welcome = match SmtpSink::start()? {
        Some(mut sink) => {
            let mut row = Vec::new();
            for (lang, guest) in [("Rust", "welcome_email"), ("Python", "welcome_email_py")] {
                let queues = WELCOME_QUEUE.replace(
                    "plugin = \"welcome_email\"",
                    &format!("plugin = \"{guest}\""),
                ) + &format!(
                    "[email]\ntransport = \"smtp\"\nfrom = \"bench@example.com\"\n\
                     host = \"127.0.0.1\"\nport = {}\ntls = \"none\"\n",
                    sink.port
                );
                let bytes = std::fs::read(bench.plugins.join(format!("{guest}.wasm")))?;
                let spread =
                    drains_once_serving(bench, &queues, "welcome", guest, &bytes, welcome_payload)
                        .await?;
                note(format!("9: {lang}: {guest} over SMTP {spread} jobs/s"));
                row.push(format!("{lang} {spread}"));
            }
            let received = sink.received()?;
            ensure!(
                received == 2 * RUNS * LANG_JOBS,
                "the SMTP sink received {received} messages for {} jobs",
                2 * RUNS * LANG_JOBS
            );
            row.join(" / ")
        }
        None => "not measured (python3 -m pip install aiosmtpd)".to_owned(),
    };

    let payments = PaymentsServer::start().await?;
    let mut charge = Vec::new();
    for (lang, guest) in [("Rust", "charge_customer"), ("JS", "charge_customer_js")] {
        let queues = format!(
            "[queues.charge]\nplugin = \"{guest}\"\nconcurrency = 16\ngrants = {{ http = [\"payments\"] }}\n\
             [http.payments]\nbase_url = \"{}\"\nidempotency_header = \"Idempotency-Key\"\n",
            payments.url()
        );
        let bytes = std::fs::read(bench.plugins.join(format!("{guest}.wasm")))?;
        let spread =
            drains_once_serving(bench, &queues, "charge", guest, &bytes, charge_payload).await?;
        note(format!("9: {lang}: {guest} over HTTP {spread} jobs/s"));
        charge.push(format!("{lang} {spread}"));
    }
    // Each run is a fresh daemon and ledger: every job charges once.
    ensure!(
        payments.requests() == 2 * RUNS * LANG_JOBS,
        "the payments server received {} charges for {} jobs",
        payments.requests(),
        2 * RUNS * LANG_JOBS
    );

    let n = thousands(LANG_JOBS as f64);
    Ok(vec![
        Row::report("9a. component size of echo", sizes.join(" / ")),
        Row::report("9b. compile, cold (s, median of 3)", cold.join(" / ")),
        Row::report(
            "9c. compile, warm: wasmtime's code cache (s)",
            warm.join(" / "),
        ),
        Row::report(
            "9d. one echo invocation (instantiate + call + drop)",
            calls.join(" / "),
        ),
        Row::report(
            &format!("9e. echo jobs/s ({n} due at once, concurrency 16)"),
            rates.join(" / "),
        ),
        Row::report(
            &format!("9f. welcome_email jobs/s, SMTP to aiosmtpd ({n} due at once)"),
            welcome,
        ),
        Row::report(
            &format!("9g. charge_customer jobs/s, HTTP to the payments API ({n} due at once)"),
            charge.join(" / "),
        ),
    ])
}

/// A host like the daemon's: the pooling allocator, the limits, and the
/// code cache in `cache` when given.
fn host(cache: Option<&std::path::Path>) -> anyhow::Result<Host> {
    Host::new(
        &PoolSize {
            instances: 16,
            max_memory: MEMORY,
        },
        cache,
    )
}

/// Median seconds to load `bytes` into a host with an empty code cache, and
/// into a second host on that cache.
fn compile_times(bench: &Bench, guest: &str, bytes: &[u8]) -> anyhow::Result<(String, String)> {
    let (mut cold, mut warm) = (Vec::new(), Vec::new());
    for _ in 0..COMPILES {
        let cache = bench.fresh_dir("code-cache")?;
        for (times, expected) in [
            (&mut cold, CodeSource::Compiled),
            (&mut warm, CodeSource::Cache),
        ] {
            let host = host(Some(&cache))?;
            let started = Instant::now();
            let plugin = host.load(guest, bytes)?;
            times.push(started.elapsed().as_secs_f64());
            ensure!(
                plugin.code == expected,
                "{guest}: expected {}, the code was {}",
                expected.as_str(),
                plugin.code.as_str()
            );
        }
        // wasmtime's cache worker may still be writing statistics into it;
        // what is left goes with the bench's root directory.
        let _ = std::fs::remove_dir_all(&cache);
    }
    Ok((Spread::of(cold).decimals(2), Spread::of(warm).decimals(3)))
}

/// Mean µs of one invocation of `guest` (an echo twin) in this process.
async fn invocation_micros(bench: &Bench, guest: &str) -> anyhow::Result<f64> {
    let bed = InvocationBed::echo(bench, host(None)?, guest, MEMORY)?;
    for i in 0..LANG_WARM_UP {
        bed.invoke(i).await?;
    }
    let started = Instant::now();
    for i in 0..LANG_INVOCATIONS {
        bed.invoke(i).await?;
    }
    Ok(started.elapsed().as_secs_f64() * 1e6 / LANG_INVOCATIONS as f64)
}

/// [`RUNS`] drains of [`LANG_JOBS`] jobs, each on a fresh daemon once it
/// serves `guest` (compiled before the jobs are due, so that the rate is
/// the handler's and not its compile).
async fn drains_once_serving(
    bench: &Bench,
    queues: &str,
    queue: &str,
    guest: &str,
    bytes: &[u8],
    payload: impl Fn(usize) -> serde_json::Value,
) -> anyhow::Result<Spread> {
    let version = sha256_hex(bytes);
    let mut rates = Vec::with_capacity(RUNS);
    for _ in 0..RUNS {
        let daemon: Daemon = bench.daemon(queues, &[guest]).await?;
        wait_serving(&daemon.api, &[(queue, version.clone())]).await?;
        rates.push(drain_rate(&daemon, queue, LANG_JOBS, &payload).await?);
    }
    Ok(Spread::of(rates))
}
