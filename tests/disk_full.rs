//! A ledger on a filesystem that fills up (issue 20): the daemon's data
//! directory is a small tmpfs of the test's own, mounted before the daemon
//! starts and unmounted at the end (so these tests need root, as CI has).
//! Enqueues of big payloads fill it to ENOSPC; the store must then refuse
//! what it cannot keep, stop (the daemon exits non-zero so that systemd
//! restarts it), and, once there is room again, start from what is durable:
//! every job that was acknowledged is there and runs. On SQLite nothing
//! refused is: the failed transaction rolls back. sled cannot take back a
//! batch whose flush failed (part of it may already be in its log), so there
//! a refused enqueue is either absent or a whole job that runs: a `503` is
//! "not known to be stored", and the producer's retry with the same id is
//! what makes it one job either way.

use crate::support;

use std::path::{Path, PathBuf};
use std::process::Command;
use std::time::Duration;

use serde_json::{Value, json};
use support::Daemon;

/// A tmpfs mounted at a directory; unmounted (lazily, so that a file still
/// open cannot keep it) when dropped, also on panic.
struct Tmpfs(PathBuf);

impl Tmpfs {
    fn mount(at: &Path, size: &str) -> Tmpfs {
        std::fs::create_dir_all(at).expect("mount point");
        run(Command::new("mount")
            .args(["-t", "tmpfs", "-o"])
            .arg(format!("size={size},mode=0700"))
            .arg("tmpfs")
            .arg(at));
        Tmpfs(at.to_owned())
    }

    fn resize(&self, size: &str) {
        run(Command::new("mount")
            .args(["-o"])
            .arg(format!("remount,size={size}"))
            .arg(&self.0));
    }
}

impl Drop for Tmpfs {
    fn drop(&mut self) {
        let _ = Command::new("umount").arg("-l").arg(&self.0).status();
    }
}

fn run(cmd: &mut Command) {
    let out = cmd.output().expect("run mount");
    assert!(
        out.status.success(),
        "{cmd:?} failed ({}): {}; these tests mount a tmpfs and need root",
        out.status,
        String::from_utf8_lossy(&out.stderr)
    );
}

/// Fills a ledger on a 24 MiB tmpfs with jobs of 200 KiB payloads until
/// the store refuses one, then checks that the daemon stopped, and that
/// after the filesystem grows and the daemon restarts every acknowledged
/// job is there and completes, and the first refused one is absent (or, when
/// `refused_may_stay`, absent or a whole job that completes).
async fn fills_to_enospc(store_toml: &str, refused_may_stay: bool) {
    let mut d = Daemon::prepare(
        &format!("{store_toml}[queues.echo]\nplugin = \"echo\"\nconcurrency = 4\n"),
        &[("echo", "echo")],
    );
    let disk = Tmpfs::mount(&d.dir.path().join("data"), "24m");
    d.start().await;
    d.wait_plugin("echo").await;

    let filler = "x".repeat(200 << 10);
    let mut acknowledged: Vec<String> = Vec::new();
    let mut refused: Vec<(String, u16, Value)> = Vec::new();
    // 24 MiB holds at most about 120 payloads of 200 KiB; the queue runs
    // some meanwhile, but keeps each until retention removes it.
    for i in 0..400 {
        let id = format!("fill-{i}");
        let sent = d
            .http
            .post(format!("{}/v1/queues/echo/jobs", d.url))
            .json(&json!({"id": id, "payload": {"fill": filler}}))
            .send()
            .await;
        // No answer: the store stopped on a write of its own (a finish)
        // and the daemon has gone.
        let Ok(resp) = sent else { break };
        let status = resp.status().as_u16();
        let v: Value = resp.json().await.unwrap_or(Value::Null);
        if status == 201 {
            acknowledged.push(id);
        } else {
            refused.push((id, status, v));
            break;
        }
    }
    assert!(
        acknowledged.len() < 400,
        "400 payloads of 200 KiB fitted in 24 MiB; log:\n{}",
        d.log()
    );
    // What was refused was refused as the store being unavailable.
    let first = refused.first().map(|(id, status, v)| {
        assert_eq!(*status, 503, "{id}: {v}\nlog:\n{}", d.log());
        assert_eq!(v["error"]["code"], "storage_unavailable", "{id}: {v}");
        id.clone()
    });

    // The store stopped: the daemon exits non-zero by itself.
    let exit = d.wait_exit(Duration::from_secs(30)).await;
    assert!(!exit.success(), "exit status {exit}");
    let log = d.log();
    assert!(
        log.contains("the daemon exits so that it is restarted"),
        "{log}"
    );

    // Room again: recovery starts from what is durable.
    disk.resize("256m");
    d.start().await;
    d.wait_plugin("echo").await;
    for id in &acknowledged {
        let job = d.wait_state(id, "completed", 60).await;
        assert_eq!(
            job["result"]["fill"].as_str().map(str::len),
            Some(200 << 10),
            "{id}"
        );
    }
    if let Some(first) = first {
        let (status, v) = d.call("GET", &format!("/v1/jobs/{first}"), None).await;
        if refused_may_stay && status == 200 {
            let job = d.wait_state(&first, "completed", 60).await;
            assert_eq!(
                job["result"]["fill"].as_str().map(str::len),
                Some(200 << 10),
                "the refused enqueue {first} stayed, but not whole"
            );
        } else {
            assert_eq!(status, 404, "the refused enqueue {first} left nothing: {v}");
        }
    }
    // And the ledger takes new work.
    let (status, v) = d
        .call(
            "POST",
            "/v1/queues/echo/jobs",
            Some(json!({"id": "after", "payload": {"n": 1}})),
        )
        .await;
    assert_eq!(status, 201, "{v}");
    d.wait_state("after", "completed", 30).await;
    d.terminate();
}

#[tokio::test]
async fn a_full_disk_stops_a_sqlite_ledger_and_loses_nothing_acknowledged() {
    fills_to_enospc("", false).await;
}

#[tokio::test]
async fn a_full_disk_stops_a_sled_ledger_and_loses_nothing_acknowledged() {
    fills_to_enospc("[store]\nbackend = \"sled\"\n\n", true).await;
}
