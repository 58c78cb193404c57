//! Figure 8: the plugin life cycle. A new build renamed into `plugins_dir`
//! until the daemon serves it; ten queues' plugins served from a cold and
//! a warm start; and the cost of the sandbox's in-engine limits.

use super::*;
pub async fn figure_plugins(bench: &Bench) -> anyhow::Result<Vec<Row>> {
    let echo = std::fs::read(bench.plugins.join("echo.wasm")).context("reading echo.wasm")?;

    // 8a: a new build renamed over the running one, until it serves.
    let daemon = bench.daemon("[queues.q]\nplugin = \"p\"\n", &[]).await?;
    let plugins_dir = daemon.dir.join("plugins");
    let mut swaps = Vec::with_capacity(RELOADS);
    for n in 0..=RELOADS {
        let build = distinct_build(&echo, n);
        let tmp = plugins_dir.join(".p.wasm.tmp");
        std::fs::write(&tmp, &build)?;
        let started = Instant::now();
        std::fs::rename(&tmp, plugins_dir.join("p.wasm"))?;
        wait_serving(&daemon.api, &[("q", sha256_hex(&build))]).await?;
        // Build 0 is the first load, not a swap.
        if n > 0 {
            swaps.push(started.elapsed().as_secs_f64());
        }
    }
    drop(daemon);
    let swap = Spread::of(swaps).decimals(2);
    note(format!(
        "8a: new build serving after {swap} s ({RELOADS} swaps, 200 ms of them the debounce)"
    ));

    // 8b: start with 10 plugins, cold and warm.
    let queues: String = (0..START_PLUGINS)
        .map(|i| format!("[queues.q{i}]\nplugin = \"p{i}\"\n"))
        .collect();
    let (mut cold, mut warm) = (Vec::new(), Vec::new());
    for run in 0..RUNS {
        let mut daemon = bench.prepare(&queues, &[])?;
        let mut expect = Vec::with_capacity(START_PLUGINS);
        for i in 0..START_PLUGINS {
            let build = distinct_build(&echo, 100 * (run + 1) + i);
            std::fs::write(
                daemon.dir.join("plugins").join(format!("p{i}.wasm")),
                &build,
            )?;
            expect.push((format!("q{i}"), sha256_hex(&build)));
        }
        let expect: Vec<(&str, String)> = expect
            .iter()
            .map(|(q, h)| (q.as_str(), h.clone()))
            .collect();
        for times in [&mut cold, &mut warm] {
            let started = Instant::now();
            daemon.spawn()?;
            daemon.wait_healthy().await?;
            wait_serving(&daemon.api, &expect).await?;
            times.push(started.elapsed().as_secs_f64());
            daemon.kill9()?;
        }
    }
    let (cold, warm) = (Spread::of(cold).decimals(2), Spread::of(warm).decimals(2));
    note(format!(
        "8b: start with {START_PLUGINS} plugins ({} KiB each): cold {cold} s, warm {warm} s",
        echo.len() / 1024
    ));

    // 8c: one invocation with and without the in-engine limits, in
    // alternating rounds so that drift hits both alike.
    let beds = [
        InvocationBed::new(bench, Safeguards::default())?,
        InvocationBed::new(
            bench,
            Safeguards {
                epoch_interruption: false,
                store_limits: false,
            },
        )?,
    ];
    let mut micros = [Vec::new(), Vec::new()];
    for bed in &beds {
        for i in 0..WARM_UP {
            bed.invoke(i).await?;
        }
    }
    for _ in 0..LIMIT_ROUNDS {
        for (bed, out) in beds.iter().zip(&mut micros) {
            let started = Instant::now();
            for i in 0..INVOCATIONS / LIMIT_ROUNDS {
                bed.invoke(i).await?;
            }
            out.push(started.elapsed().as_secs_f64() * 1e6 / (INVOCATIONS / LIMIT_ROUNDS) as f64);
        }
    }
    let [with, without] = micros.map(|m| Spread::of(m).decimals(1));
    note(format!(
        "8c: invocation with limits {with} µs, without {without} µs"
    ));
    Ok(vec![
        Row::report(
            "8a. plugin file renamed in → new version serving (incl. 200 ms debounce)",
            format!("{swap} s"),
        ),
        Row::report(
            &format!("8b. daemon start → {START_PLUGINS} plugins serving, cold (compile)"),
            format!("{cold} s"),
        ),
        Row::report(
            &format!("8b. daemon start → {START_PLUGINS} plugins serving, warm (code cache)"),
            format!("{warm} s"),
        ),
        Row::report(
            "8c. one echo invocation with epoch interruption + store limiter / without",
            format!("{with} µs / {without} µs"),
        ),
    ])
}

/// `component` with a custom section naming `n` appended: the same code,
/// another content hash, so the daemon treats it as a new build.
fn distinct_build(component: &[u8], n: usize) -> Vec<u8> {
    let name = b"khata-bench-build";
    let payload = n.to_le_bytes();
    let mut section = Vec::new();
    leb128(&mut section, name.len());
    section.extend_from_slice(name);
    section.extend_from_slice(&payload);
    let mut out = component.to_vec();
    out.push(0); // custom section
    leb128(&mut out, section.len());
    out.extend_from_slice(&section);
    out
}

fn leb128(out: &mut Vec<u8>, mut n: usize) {
    loop {
        let byte = (n & 0x7f) as u8;
        n >>= 7;
        if n == 0 {
            out.push(byte);
            return;
        }
        out.push(byte | 0x80);
    }
}

pub(super) fn sha256_hex(bytes: &[u8]) -> String {
    use sha2::Digest;
    hex::encode(sha2::Sha256::digest(bytes))
}

/// Waits until each `(queue, sha256)` serves that version.
pub(super) async fn wait_serving(api: &Api, expect: &[(&str, String)]) -> anyhow::Result<()> {
    let deadline = Instant::now() + DEADLINE;
    loop {
        let list = api.get("/v1/queues").await?;
        let queues = list["queues"].as_array().cloned().unwrap_or_default();
        let serving = expect.iter().all(|(name, hash)| {
            queues
                .iter()
                .any(|q| q["name"] == *name && q["sha256"] == hash.as_str())
        });
        if serving {
            return Ok(());
        }
        ensure!(
            Instant::now() < deadline,
            "the plugins never served: {list}"
        );
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
}
