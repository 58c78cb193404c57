//! The plugin life cycle through the real daemon (docs/wit.md#the-sandbox): a plugin
//! swapped under load, broken builds refused while the old version serves,
//! a missing plugin holding its jobs, and the compiled-code cache.
//!
//! Two guests that answer the same payload differently tell the versions
//! apart: `chaos` answers `{"do": "sleep", "ms": N}` with `{"slept": N}`,
//! `echo` with the payload itself.

use crate::support;

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::time::{Duration, Instant, SystemTime};

use serde_json::{Value, json};
use support::{Daemon, guest_bytes, payload, short_hash};

const SWAP: &str = r#"
[queues.swap]
plugin = "p"
concurrency = 4
timeout = "30s"
max_attempts = 1
grants = { kv = true }
"#;

/// A component that exports `handle`, but as `func() -> u32`: not the
/// khata world.
const WRONG_WORLD: &str = r#"
(component
  (core module $m (func (export "h") (result i32) i32.const 7))
  (core instance $i (instantiate $m))
  (func (export "handle") (result u32) (canon lift (core func $i "h"))))
"#;

async fn completed_count(d: &Daemon, queue: &str) -> u64 {
    d.queue(queue).await["counts"]["completed"]
        .as_u64()
        .unwrap_or(0)
}

#[tokio::test]
async fn a_plugin_swapped_under_load_loses_nothing_and_running_attempts_keep_their_version() {
    let chaos = guest_bytes("chaos");
    let echo = guest_bytes("echo");
    let (v_chaos, v_echo) = (short_hash(&chaos), short_hash(&echo));
    // The version each attempt records: the plugin's full content hash.
    let ran_on = |j: &Value| -> String {
        let v = j["attempts"][0]["plugin_version"]
            .as_str()
            .unwrap_or("none");
        v.get(..12).unwrap_or(v).to_owned()
    };
    let d = Daemon::start_new(SWAP, &[("p", "chaos")]).await;
    let q = d.wait_version("swap", &v_chaos).await;
    assert_eq!(q["sha256"].as_str().unwrap()[..12], v_chaos, "{q}");
    assert!(q["load_error"].is_null(), "{q}");
    let loaded_at = q["loaded_at"].clone();

    // An attempt that starts on chaos and is still running after the swap.
    let sleeper = d
        .enqueue(
            "swap",
            payload(json!({"do": "sleep", "ms": 6000, "tag": "sleeper"})),
        )
        .await;
    d.wait_state(&sleeper, "active", 30).await;
    // Load: 200 short jobs that run before, during and after two swaps.
    let jobs: Vec<Value> = (0..200)
        .map(|n| json!({"payload": {"do": "sleep", "ms": 30, "n": n}}))
        .collect();
    let (status, v) = d
        .call(
            "POST",
            "/v1/queues/swap/jobs/batch",
            Some(json!({"jobs": jobs})),
        )
        .await;
    assert_eq!(status, 200, "{v}");
    let ids: Vec<String> = v["results"]
        .as_array()
        .unwrap()
        .iter()
        .map(|r| r["job"]["id"].as_str().unwrap().to_owned())
        .collect();
    let deadline = Instant::now() + Duration::from_secs(30);
    while completed_count(&d, "swap").await < 20 {
        assert!(Instant::now() < deadline, "the load did not start");
        tokio::time::sleep(Duration::from_millis(10)).await;
    }

    // Swap 1: an atomic rename, as deploy tools do.
    d.replace_plugin("p", &echo);
    let q = d.wait_version("swap", &v_echo).await;
    assert!(q["load_error"].is_null(), "{q}");
    assert_ne!(q["loaded_at"], loaded_at, "{q}");
    assert_eq!(
        d.job(&sleeper).await["state"],
        "active",
        "the sleeper must still be running on the old version when the new one serves"
    );
    // A job enqueued now runs on the new version (priority: ahead of the load).
    let after = d
        .enqueue(
            "swap",
            json!({"payload": {"do": "sleep", "ms": 10, "tag": "after-1"}, "priority": 10}),
        )
        .await;
    let j = d.wait_state(&after, "completed", 30).await;
    assert_eq!(
        j["result"],
        json!({"do": "sleep", "ms": 10, "tag": "after-1"}),
        "echo answered: {j}"
    );
    assert_eq!(ran_on(&j), v_echo, "{j}");
    assert!(
        d.cli_queues().contains(&v_echo),
        "khata queues shows the new version"
    );

    // The attempt that started on chaos finished on chaos.
    let j = d.wait_state(&sleeper, "completed", 30).await;
    assert_eq!(j["result"], json!({"slept": 6000}), "{j}");
    assert_eq!(j["attempts"].as_array().unwrap().len(), 1, "{j}");
    assert_eq!(
        ran_on(&j),
        v_chaos,
        "its attempt records the old version: {j}"
    );

    // Swap 2: written in place (truncate and write, as `cp` does).
    d.overwrite_plugin("p", &chaos);
    d.wait_version("swap", &v_chaos).await;
    let after = d
        .enqueue(
            "swap",
            json!({"payload": {"do": "sleep", "ms": 10, "tag": "after-2"}, "priority": 10}),
        )
        .await;
    let j = d.wait_state(&after, "completed", 30).await;
    assert_eq!(j["result"], json!({"slept": 10}), "chaos answered: {j}");

    // No job of the load was lost or failed because of the swaps, and each
    // ran on one version or the other.
    let (mut on_chaos, mut on_echo) = (0, 0);
    for (n, id) in ids.iter().enumerate() {
        let j = d.wait_state(id, "completed", 60).await;
        let attempts = j["attempts"].as_array().unwrap();
        assert_eq!(attempts.len(), 1, "{j}");
        assert_eq!(attempts[0]["outcome"], "completed", "{j}");
        if j["result"] == json!({"slept": 30}) {
            assert_eq!(ran_on(&j), v_chaos, "{j}");
            on_chaos += 1;
        } else {
            assert_eq!(j["result"], json!({"do": "sleep", "ms": 30, "n": n}), "{j}");
            assert_eq!(ran_on(&j), v_echo, "{j}");
            on_echo += 1;
        }
    }
    assert!(
        on_chaos >= 20 && on_echo >= 1,
        "chaos {on_chaos}, echo {on_echo}"
    );
    let counts = d.queue("swap").await["counts"].clone();
    assert_eq!(counts["completed"], 203, "{counts}");
    assert_eq!(counts["dead"], 0, "{counts}");
}

#[tokio::test]
async fn a_broken_build_is_refused_and_the_old_version_keeps_serving() {
    let echo = guest_bytes("echo");
    let v_echo = short_hash(&echo);
    let d = Daemon::start_new(
        "[queues.b]\nplugin = \"p\"\nmax_attempts = 1\n",
        &[("p", "echo")],
    )
    .await;
    d.wait_version("b", &v_echo).await;
    let wrong_world = wat::parse_str(WRONG_WORLD).expect("WAT");
    let cases: [(&str, Vec<u8>, bool, &str); 4] = [
        (
            "garbage, written in place",
            b"this is not wasm".to_vec(),
            false,
            "not a WebAssembly component",
        ),
        (
            "a truncated component, renamed in",
            echo[..echo.len() / 2].to_vec(),
            true,
            "not a WebAssembly component",
        ),
        (
            "a component of another world",
            wrong_world,
            true,
            "does not fit the khata:plugin/handler world",
        ),
        (
            "a plugin importing kv, which queue b is not granted",
            guest_bytes("chaos"),
            false,
            "imports khata:plugin/kv but queue \"b\" is not granted it",
        ),
    ];
    for (what, bytes, rename, reason) in cases {
        if rename {
            d.replace_plugin("p", &bytes);
        } else {
            d.overwrite_plugin("p", &bytes);
        }
        let q = d
            .wait_queue("b", &format!("refusing {what}"), 30, |q| {
                q["load_error"].as_str().is_some_and(|e| e.contains(reason))
            })
            .await;
        let error = q["load_error"].as_str().unwrap();
        assert!(error.contains("\"p\""), "{what}: names the plugin: {error}");
        assert_eq!(q["version"], v_echo, "{what}: the old version serves: {q}");
        let queues = d.cli_queues();
        assert!(
            queues.contains(reason) && queues.contains(&v_echo),
            "{what}: khata queues shows the error and the serving version:\n{queues}"
        );
        let id = d.enqueue("b", payload(json!({"what": what}))).await;
        let j = d.wait_state(&id, "completed", 30).await;
        assert_eq!(j["result"], json!({"what": what}), "echo still answers");
        // A good file clears the error (and the next case starts clean).
        d.replace_plugin("p", &echo);
        let q = d
            .wait_queue("b", "healthy again", 30, |q| q["load_error"].is_null())
            .await;
        assert_eq!(q["version"], v_echo, "{q}");
    }
    assert!(
        d.log().contains("plugin refused"),
        "each refusal is logged:\n{}",
        d.log()
    );

    // A removed file: the loaded version goes on serving, and says so.
    std::fs::remove_file(d.plugin_file("p")).unwrap();
    let q = d
        .wait_queue("b", "reporting the missing file", 30, |q| {
            q["load_error"]
                .as_str()
                .is_some_and(|e| e.contains("missing"))
        })
        .await;
    assert_eq!(q["version"], v_echo, "{q}");
    let id = d.enqueue("b", payload(json!({"gone": true}))).await;
    d.wait_state(&id, "completed", 30).await;

    // A good file again clears the error.
    d.replace_plugin("p", &echo);
    let q = d
        .wait_queue("b", "healthy again", 30, |q| q["load_error"].is_null())
        .await;
    assert_eq!(q["version"], v_echo, "{q}");
}

#[tokio::test]
async fn a_missing_plugin_holds_its_jobs_until_it_appears() {
    let mut d = Daemon::prepare(
        "[queues.later]\nplugin = \"later\"\n[queues.now]\nplugin = \"echo\"\n",
        &[("echo", "echo")],
    );
    d.start().await;
    d.wait_plugin("now").await;
    let q = d
        .wait_queue("later", "reporting its missing plugin", 30, |q| {
            !q["load_error"].is_null()
        })
        .await;
    assert!(q["version"].is_null(), "{q}");
    let error = q["load_error"].as_str().unwrap();
    assert!(
        error.contains("later.wasm") && error.contains("wait until it appears"),
        "{error}"
    );
    let queues = d.cli_queues();
    assert!(queues.contains("later.wasm"), "{queues}");

    let mut ids = Vec::new();
    for n in 0..5 {
        ids.push(d.enqueue("later", payload(json!({"n": n}))).await);
    }
    let other = d.enqueue("now", payload(json!({"other": true}))).await;
    d.wait_state(&other, "completed", 30).await;
    tokio::time::sleep(Duration::from_millis(1500)).await;
    let q = d.queue("later").await;
    assert_eq!(q["counts"]["waiting"], 5, "held, not run or failed: {q}");
    for id in &ids {
        let j = d.job(id).await;
        assert_eq!(j["state"], "waiting", "{j}");
        assert!(j["attempts"].as_array().unwrap().is_empty(), "{j}");
    }

    d.replace_plugin("later", &guest_bytes("echo"));
    for (n, id) in ids.iter().enumerate() {
        let j = d.wait_state(id, "completed", 30).await;
        assert_eq!(j["result"], json!({"n": n}));
    }
    let q = d.queue("later").await;
    assert!(q["load_error"].is_null(), "{q}");
    assert_eq!(q["version"], short_hash(&guest_bytes("echo")), "{q}");
}

/// The entries of wasmtime's cache under `data/code-cache` (not its
/// bookkeeping files), with their modification times.
fn cache_entries(data: &Path) -> BTreeMap<PathBuf, SystemTime> {
    let modules = data.join("code-cache/modules");
    let mut entries = BTreeMap::new();
    for dir in std::fs::read_dir(&modules).into_iter().flatten().flatten() {
        for f in std::fs::read_dir(dir.path())
            .into_iter()
            .flatten()
            .flatten()
        {
            let name = f.file_name().to_string_lossy().into_owned();
            if name.ends_with(".stats") || name.contains(".wip") {
                continue;
            }
            let mtime = f.metadata().and_then(|m| m.modified()).unwrap();
            entries.insert(f.path(), mtime);
        }
    }
    entries
}

#[tokio::test]
async fn compiled_code_is_cached_in_data_dir_and_a_restart_does_not_recompile() {
    let echo = guest_bytes("echo");
    let v_echo = short_hash(&echo);
    let mut d = Daemon::start_new("[queues.echo]\nplugin = \"echo\"\n", &[("echo", "echo")]).await;
    let q = d.wait_version("echo", &v_echo).await;
    assert_eq!(q["code"], "compiled", "a fresh data_dir has no cache: {q}");
    let data = d.dir.path().join("data");
    let first = cache_entries(&data);
    assert_eq!(first.len(), 1, "one entry for one plugin: {first:?}");
    let dir = first.keys().next().unwrap().parent().unwrap();
    let dir_name = dir.file_name().unwrap().to_string_lossy().into_owned();
    assert!(
        dir_name.starts_with("wasmtime-48."),
        "entries are kept per wasmtime version: {dir_name}"
    );

    d.terminate();
    d.start().await;
    let q = d.wait_version("echo", &v_echo).await;
    assert_eq!(q["code"], "cache", "the restart read the cached code: {q}");
    assert_eq!(
        cache_entries(&data),
        first,
        "no new entry, none rewritten: the plugin was not compiled again"
    );
    let id = d
        .enqueue("echo", payload(json!({"after": "restart"})))
        .await;
    let j = d.wait_state(&id, "completed", 30).await;
    assert_eq!(j["result"], json!({"after": "restart"}));

    // A version swapped out and back is not compiled again either.
    d.replace_plugin("echo", &guest_bytes("update_search_index"));
    d.wait_queue("echo", "refusing the ungranted plugin", 30, |q| {
        !q["load_error"].is_null()
    })
    .await;
    d.replace_plugin("echo", &echo);
    let q = d
        .wait_queue("echo", "back on echo", 30, |q| q["load_error"].is_null())
        .await;
    assert_eq!(q["code"], "cache", "{q}");
    assert!(
        d.log()
            .lines()
            .any(|l| l.contains("plugin loaded") && l.contains("\"cache\"")),
        "the load is logged with where its code came from:\n{}",
        d.log()
    );
}

#[tokio::test]
async fn a_plugins_dir_created_after_the_start_is_found_and_then_watched() {
    let mut d = Daemon::prepare("[queues.echo]\nplugin = \"echo\"\n", &[]);
    let dir = d.dir.path().join("plugins");
    std::fs::remove_dir(&dir).unwrap();
    d.start().await;
    assert!(
        d.log().contains("cannot watch the plugins directory"),
        "{}",
        d.log()
    );
    std::fs::create_dir(&dir).unwrap();
    d.replace_plugin("echo", &guest_bytes("echo"));
    d.wait_version("echo", &short_hash(&guest_bytes("echo")))
        .await;
    let id = d.enqueue("echo", payload(json!({"late": true}))).await;
    d.wait_state(&id, "completed", 30).await;
    // Watched from now on: removing the directory is noticed, and a new one
    // is watched again once it exists.
    std::fs::remove_dir_all(&dir).unwrap();
    d.wait_queue("echo", "reporting the missing file", 30, |q| {
        q["load_error"]
            .as_str()
            .is_some_and(|e| e.contains("missing"))
    })
    .await;
    std::fs::create_dir(&dir).unwrap();
    d.replace_plugin("echo", &guest_bytes("echo"));
    d.wait_queue("echo", "loaded again", 30, |q| q["load_error"].is_null())
        .await;
    let watching = d
        .log()
        .lines()
        .filter(|l| l.contains("watching the plugins directory"))
        .count();
    assert!(
        watching >= 2,
        "watched again after each appearance:\n{}",
        d.log()
    );
}

#[tokio::test]
async fn a_symlinked_plugins_dir_switched_to_another_release_is_followed() {
    let mut d = Daemon::prepare("[queues.q]\nplugin = \"p\"\ngrants = { kv = true }\n", &[]);
    // plugins -> releases/1, as a deploy tool lays out releases.
    let plugins = d.dir.path().join("plugins");
    std::fs::remove_dir(&plugins).unwrap();
    let releases = d.dir.path().join("releases");
    for (n, guest) in [("1", "chaos"), ("2", "echo")] {
        std::fs::create_dir_all(releases.join(n)).unwrap();
        std::fs::write(releases.join(n).join("p.wasm"), guest_bytes(guest)).unwrap();
    }
    std::os::unix::fs::symlink("releases/1", &plugins).unwrap();
    d.start().await;
    d.wait_version("q", &short_hash(&guest_bytes("chaos")))
        .await;

    // Switch atomically: a new link renamed over the old one.
    let next = d.dir.path().join("plugins.next");
    std::os::unix::fs::symlink("releases/2", &next).unwrap();
    std::fs::rename(&next, &plugins).unwrap();
    d.wait_version("q", &short_hash(&guest_bytes("echo"))).await;
    let id = d.enqueue("q", payload(json!({"release": 2}))).await;
    let j = d.wait_state(&id, "completed", 30).await;
    assert_eq!(j["result"], json!({"release": 2}), "{j}");

    // Still watched after the switch: a change in the new target is seen.
    d.replace_plugin("p", &guest_bytes("chaos"));
    d.wait_version("q", &short_hash(&guest_bytes("chaos")))
        .await;
}

#[tokio::test]
async fn sighup_applies_a_changed_jobs_toml_and_refuses_a_bad_one() {
    let v_chaos = short_hash(&guest_bytes("chaos"));
    let d = Daemon::start_new(
        "[queues.a]\nplugin = \"echo\"\nconcurrency = 1\n",
        &[("echo", "echo"), ("chaos", "chaos")],
    )
    .await;
    d.wait_plugin("a").await;

    // Queue a changes plugin, grants and concurrency; queue b is new.
    d.rewrite_config(
        "[queues.a]\nplugin = \"chaos\"\nconcurrency = 3\ngrants = { kv = true }\n\
         [queues.b]\nplugin = \"echo\"\n",
    );
    d.hup();
    let q = d.wait_version("a", &v_chaos).await;
    assert_eq!(q["plugin"], "chaos", "{q}");
    assert_eq!(q["concurrency"], 3, "{q}");
    d.wait_plugin("b").await;
    let id = d
        .enqueue("a", payload(json!({"do": "sleep", "ms": 1})))
        .await;
    assert_eq!(
        d.wait_state(&id, "completed", 30).await["result"],
        json!({"slept": 1}),
        "queue a runs chaos now"
    );
    let id = d.enqueue("b", payload(json!({"b": 1}))).await;
    assert_eq!(
        d.wait_state(&id, "completed", 30).await["result"],
        json!({"b": 1})
    );

    // A bad file (an unknown key, and a new queue c) changes nothing.
    d.rewrite_config(
        "[queues.a]\nplugin = \"chaos\"\nconcurrency = 1\ngrants = { kv = true }\n\
         [queues.b]\nplugin = \"echo\"\ncolour = \"red\"\n\
         [queues.c]\nplugin = \"echo\"\n",
    );
    d.hup();
    let deadline = Instant::now() + Duration::from_secs(30);
    while !d.log().contains("configuration reload refused") {
        assert!(Instant::now() < deadline, "no refusal logged:\n{}", d.log());
        tokio::time::sleep(Duration::from_millis(25)).await;
    }
    let refusal = d.log();
    let refusal = &refusal[refusal.find("configuration reload refused").unwrap()..];
    assert!(
        refusal.contains("colour"),
        "the error names the key: {refusal}"
    );
    let (_, v) = d.call("GET", "/v1/queues", None).await;
    let names: Vec<&str> = v["queues"]
        .as_array()
        .unwrap()
        .iter()
        .map(|q| q["name"].as_str().unwrap())
        .collect();
    assert_eq!(names, ["a", "b"], "{v}");
    assert_eq!(d.queue("a").await["concurrency"], 3);
    let id = d.enqueue("b", payload(json!({"still": true}))).await;
    d.wait_state(&id, "completed", 30).await;

    // Queue b removed, queue a down to one slot: held from the next job on.
    d.rewrite_config("[queues.a]\nplugin = \"chaos\"\nconcurrency = 1\ngrants = { kv = true }\n");
    d.hup();
    d.wait_queue("a", "down to one slot", 30, |q| q["concurrency"] == 1)
        .await;
    let (status, v) = d
        .call("POST", "/v1/queues/b/jobs", Some(json!({"payload": {}})))
        .await;
    assert_eq!(status, 404, "queue b is gone: {v}");
    let mut ids = Vec::new();
    for _ in 0..6 {
        ids.push(
            d.enqueue("a", payload(json!({"do": "slot", "ms": 50, "slots": 4})))
                .await,
        );
    }
    for id in &ids {
        let j = d.wait_state(id, "completed", 30).await;
        assert_eq!(j["result"], json!({"slot": 0}), "one at a time: {j}");
    }
}
