//! The rare crash points of an effect (docs/fences.md), hit on purpose: a failpoint holds the
//! daemon at one point of an effect while the test `kill -9`s it, then the
//! daemon restarts without the failpoint. One test per row of the table of
//! docs/fences.md#what-fence_begin-does whose outcome depends on where the crash fell. And one window that a
//! single daemon otherwise closes at once: a cancelled attempt still running
//! before its interrupt, whose effects are all `fenced`.
//!
//! Needs the `failpoints` feature (`scripts/test` enables it).

use crate::servers;
use crate::support;

use std::time::{Duration, Instant};

use serde_json::json;
use servers::{Payments, Smtp};
use support::{Daemon, payload};

const HOLD: &str = "1*return(60000)";

fn charge_config(payments: &Payments, provider_extra: &str) -> String {
    format!(
        "[queues.charge]\nplugin = \"charge_customer\"\ngrants = {{ http = [\"payments\"] }}\nmax_attempts = 3\n\
         [http.payments]\nbase_url = \"{}\"\ntimeout = \"5s\"\n{provider_extra}\n",
        payments.url()
    )
}

/// Starts a daemon with `FAILPOINTS=<point>=<HOLD>`.
async fn start_held(config: &str, plugin: &str, point: &str) -> Daemon {
    let mut d = Daemon::prepare(config, &[(plugin, plugin)]);
    d.env("FAILPOINTS", &format!("{point}={HOLD}"));
    d.start().await;
    d
}

async fn until(what: &str, d: &Daemon, mut check: impl AsyncFnMut() -> bool) {
    let deadline = Instant::now() + Duration::from_secs(30);
    while !check().await {
        assert!(
            Instant::now() < deadline,
            "timed out waiting for {what}\n{}",
            d.log()
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}

async fn fence_state(d: &Daemon, key: &str) -> Option<String> {
    let (_, v) = d.call("GET", "/v1/fences", None).await;
    v["fences"]
        .as_array()?
        .iter()
        .find(|f| f["key"] == key)
        .map(|f| f["state"].as_str().unwrap_or_default().to_owned())
}

/// `kill -9` at the held point, then restart without failpoints.
async fn crash_and_restart(d: &mut Daemon) {
    d.kill9();
    d.unset_env("FAILPOINTS");
    d.start().await;
}

fn order(id: u32) -> serde_json::Value {
    payload(json!({"order_id": id, "amount": 500, "currency": "EUR", "customer": "c"}))
}

#[tokio::test]
async fn crash_after_started_idempotent_provider_performs_once_after_restart() {
    let payments = Payments::start().await;
    let config = charge_config(&payments, "idempotency_header = \"Idempotency-Key\"");
    let mut d = start_held(&config, "charge_customer", "effect::after_started").await;
    let id = d.enqueue("charge", order(1)).await;
    until("the fence to be started", &d, async || {
        fence_state(&d, "order-charge-1").await.as_deref() == Some("started")
    })
    .await;
    crash_and_restart(&mut d).await;
    let j = d.wait_state(&id, "completed", 30).await;
    assert_eq!(
        payments.requests().len(),
        1,
        "performed once, after the restart"
    );
    assert_eq!(payments.charges(), 1);
    assert_eq!(j["attempts"][0]["outcome"], "abandoned", "{j}");
    assert_eq!(j["effects"][0]["outcome"], "performed", "{j}");
}

#[tokio::test]
async fn crash_after_started_non_idempotent_is_uncertain_under_skip() {
    let payments = Payments::start().await;
    let mut d = start_held(
        &charge_config(&payments, ""),
        "charge_customer",
        "effect::after_started",
    )
    .await;
    let id = d.enqueue("charge", order(2)).await;
    until("the fence to be started", &d, async || {
        fence_state(&d, "order-charge-2").await.as_deref() == Some("started")
    })
    .await;
    crash_and_restart(&mut d).await;
    let j = d.wait_state(&id, "dead", 30).await;
    assert!(
        j["last_error"].as_str().unwrap().contains("uncertain"),
        "{j}"
    );
    assert_eq!(
        fence_state(&d, "order-charge-2").await.as_deref(),
        Some("uncertain")
    );
    assert_eq!(
        payments.requests().len(),
        0,
        "khata cannot know, so it does not guess"
    );
    // The operator knows it did not happen: the next attempt performs it.
    let out = d.cli(&[
        "fence",
        "resolve",
        "charge",
        "http",
        "order-charge-2",
        "not-done",
    ]);
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    d.cli(&["retry", &id]);
    d.wait_state(&id, "completed", 30).await;
    assert_eq!(payments.requests().len(), 1);
}

#[tokio::test]
async fn crash_between_response_and_done_is_reconciled_with_the_provider() {
    let payments = Payments::start().await;
    let config = charge_config(
        &payments,
        "reconcile = { method = \"GET\", path = \"/v1/charges?key={key}\" }",
    );
    let mut d = start_held(&config, "charge_customer", "effect::after_response").await;
    let id = d.enqueue("charge", order(3)).await;
    until("the provider to answer", &d, async || {
        payments.requests().len() == 1
    })
    .await;
    tokio::time::sleep(Duration::from_millis(100)).await;
    assert_eq!(
        fence_state(&d, "order-charge-3").await.as_deref(),
        Some("started")
    );
    crash_and_restart(&mut d).await;
    let j = d.wait_state(&id, "completed", 30).await;
    assert_eq!(
        payments.requests().len(),
        1,
        "reconciliation found the charge: no second one"
    );
    assert_eq!(j["result"]["replayed"], true, "{j}");
    assert_eq!(j["effects"][0]["outcome"], "reconciled:done", "{j}");
}

#[tokio::test]
async fn crash_between_started_and_send_is_reconciled_as_not_done() {
    let payments = Payments::start().await;
    let config = charge_config(
        &payments,
        "reconcile = { method = \"GET\", path = \"/v1/charges?key={key}\" }",
    );
    let mut d = start_held(&config, "charge_customer", "effect::after_started").await;
    let id = d.enqueue("charge", order(4)).await;
    until("the fence to be started", &d, async || {
        fence_state(&d, "order-charge-4").await.as_deref() == Some("started")
    })
    .await;
    crash_and_restart(&mut d).await;
    let j = d.wait_state(&id, "completed", 30).await;
    assert_eq!(
        payments.requests().len(),
        1,
        "the look-up said 404, so it was performed"
    );
    assert_eq!(j["effects"][0]["outcome"], "reconciled:not-done", "{j}");
    assert_eq!(j["effects"][1]["outcome"], "performed", "{j}");
}

#[tokio::test]
async fn crash_after_done_before_completion_replays() {
    let payments = Payments::start().await;
    let mut d = start_held(
        &charge_config(&payments, ""),
        "charge_customer",
        "queue::before_finish",
    )
    .await;
    let id = d.enqueue("charge", order(5)).await;
    until("the fence to be done", &d, async || {
        fence_state(&d, "order-charge-5").await.as_deref() == Some("done")
    })
    .await;
    crash_and_restart(&mut d).await;
    let j = d.wait_state(&id, "completed", 30).await;
    assert_eq!(
        payments.requests().len(),
        1,
        "a done effect is never repeated"
    );
    assert_eq!(j["result"]["replayed"], true, "{j}");
    let outcomes: Vec<_> = j["effects"]
        .as_array()
        .unwrap()
        .iter()
        .map(|e| (e["attempt"].clone(), e["outcome"].clone()))
        .collect();
    assert_eq!(
        outcomes,
        [
            (json!(1), json!("performed")),
            (json!(2), json!("replayed"))
        ]
    );
}

#[tokio::test]
async fn smtp_crash_after_the_server_answered_is_uncertain_not_repeated() {
    let tmp = tempfile::tempdir().unwrap();
    let smtp = Smtp::start(&tmp.path().join("mail"));
    let config = format!(
        "[queues.welcome]\nplugin = \"welcome_email\"\ngrants = {{ kv = true, email = true }}\nmax_attempts = 2\n\
         [email]\ntransport = \"smtp\"\nfrom = \"hello@example.com\"\nhost = \"127.0.0.1\"\nport = {}\n",
        smtp.port
    );
    let mut d = start_held(&config, "welcome_email", "effect::after_response").await;
    let id = d
        .enqueue(
            "welcome",
            payload(json!({"user_id": 1, "email": "a@example.com", "name": "A"})),
        )
        .await;
    until("the message to arrive", &d, async || {
        smtp.messages().len() == 1
    })
    .await;
    crash_and_restart(&mut d).await;
    d.wait_state(&id, "dead", 30).await;
    assert_eq!(
        fence_state(&d, "welcome:1").await.as_deref(),
        Some("uncertain")
    );
    assert_eq!(smtp.messages().len(), 1, "never a second email under skip");
}

#[tokio::test]
async fn outbox_crash_after_write_is_reconciled_by_its_file() {
    let config =
        "[queues.welcome]\nplugin = \"welcome_email\"\ngrants = { kv = true, email = true }\n";
    let mut d = start_held(config, "welcome_email", "effect::after_response").await;
    let id = d
        .enqueue(
            "welcome",
            payload(json!({"user_id": 2, "email": "b@example.com", "name": "B"})),
        )
        .await;
    let outbox = d.dir.path().join("data/outbox");
    // Only published messages count: the writer's temporary file comes first
    // and may be left behind by the kill.
    let eml_files = || {
        std::fs::read_dir(&outbox)
            .map(|r| {
                r.filter(|e| {
                    e.as_ref()
                        .is_ok_and(|e| e.path().extension().is_some_and(|x| x == "eml"))
                })
                .count()
            })
            .unwrap_or(0)
    };
    until("the .eml file", &d, async || eml_files() == 1).await;
    crash_and_restart(&mut d).await;
    let j = d.wait_state(&id, "completed", 30).await;
    assert_eq!(eml_files(), 1, "one message");
    assert_eq!(j["effects"][0]["outcome"], "reconciled:done", "{j}");
}

fn stale_config(payments: &Payments) -> String {
    format!(
        "[queues.stale]\nplugin = \"stale\"\ntimeout = \"60s\"\nmax_attempts = 1\n\
         grants = {{ kv = true, index = [\"docs\"], email = true, http = [\"payments\"] }}\n\
         [email]\ntransport = \"outbox\"\nfrom = \"hello@example.com\"\n\
         [http.payments]\nbase_url = \"{}\"\ntimeout = \"5s\"\n",
        payments.url()
    )
}

/// The daemon's log lines (`KHATA_LOG_FORMAT=json`), parsed.
fn log_lines(d: &Daemon) -> Vec<serde_json::Value> {
    d.log()
        .lines()
        .filter_map(|l| serde_json::from_str(l).ok())
        .collect()
}

/// What the guest logged for job `id`, the lines that start with `prefix`.
fn guest_lines(d: &Daemon, id: &str, prefix: &str) -> Vec<String> {
    log_lines(d)
        .into_iter()
        .filter(|v| v["target"] == "khata::guest" && v["fields"]["job"] == id)
        .filter_map(|v| v["fields"]["message"].as_str().map(str::to_owned))
        .filter(|m| m.starts_with(prefix))
        .collect()
}

/// docs/fences.md#fencing: an attempt that no longer holds its job gets `fenced`
/// from every effect call and changes nothing.
///
/// A cancel commits the job's new state, then interrupts the attempt still
/// running; the failpoint `queue::before_interrupt` holds the interrupt for
/// 2 s after that commit, so the attempt goes on running with a lost lease.
/// The `stale` guest puts 1, 2, 3, ... into kv `counter` meanwhile; its first
/// put after the cancel is refused, and it then calls every other effect once
/// (kv, index, email, http) and logs what each answered.
#[tokio::test]
async fn a_cancelled_attempt_still_running_is_fenced_from_every_effect() {
    let payments = Payments::start().await;
    let mut d = Daemon::prepare(&stale_config(&payments), &[("stale", "stale")]);
    d.env("FAILPOINTS", "queue::before_interrupt=1*return(2000)");
    d.env("KHATA_LOG_FORMAT", "json");
    d.start().await;
    d.wait_plugin("stale").await;
    let id = d.enqueue("stale", payload(json!({"do": "loop"}))).await;
    until("the guest to be putting", &d, async || {
        !guest_lines(&d, &id, "stale: looping").is_empty()
    })
    .await;

    // Answered after the failpoint let the interrupt go.
    let (status, v) = d.call("DELETE", &format!("/v1/jobs/{id}"), None).await;
    assert_eq!(
        (status, &v["job"]["state"]),
        (200, &json!("cancelled")),
        "{v}"
    );
    until("the attempt to end", &d, async || {
        d.job(&id).await["attempts"][0]["outcome"] == "cancelled"
    })
    .await;
    assert!(
        log_lines(&d)
            .iter()
            .any(|l| l["fields"]["failpoint"] == "queue::before_interrupt"),
        "the interrupt went through the failpoint\n{}",
        d.log()
    );

    let probes = guest_lines(&d, &id, "stale-probe ");
    assert_eq!(
        probes.len(),
        1,
        "the guest saw a put refused while still running\n{}",
        d.log()
    );
    let probe: serde_json::Value =
        serde_json::from_str(probes[0].trim_start_matches("stale-probe ")).unwrap();
    let last_ok = probe["last_ok"].as_u64().unwrap();
    assert!(last_ok >= 1, "{probe}");
    assert_eq!(
        probe,
        json!({
            "last_ok": last_ok,
            "refused_round": last_ok + 1,
            "put": "fenced",
            "kv_get": "fenced",
            "kv_insert_if_absent": "fenced",
            "kv_delete": "fenced",
            "index_upsert": "fenced",
            "index_remove": "fenced",
            "index_get": "fenced",
            "email_send": "fenced",
            "http_send": "fenced",
        }),
        "every effect after the cancel is fenced"
    );

    // The job stays cancelled although the handler returned Ok; the
    // refused external calls are recorded on the attempt.
    let j = d.job(&id).await;
    assert_eq!(j["state"], "cancelled", "{j}");
    assert!(j["result"].is_null(), "{j}");
    let effects: Vec<_> = j["effects"]
        .as_array()
        .unwrap()
        .iter()
        .map(|e| {
            (
                e["attempt"].clone(),
                e["kind"].clone(),
                e["outcome"].clone(),
            )
        })
        .collect();
    assert_eq!(
        effects,
        [
            (json!(1), json!("email"), json!("refused:fenced")),
            (json!(1), json!("http"), json!("refused:fenced"))
        ]
    );
    let metrics = d.metrics().await;
    for kind in ["email", "http"] {
        assert!(
            metrics.lines().any(|l| l.starts_with("khata_effects_total")
                && l.contains(&format!("kind=\"{kind}\""))
                && l.contains("outcome=\"refused:fenced\"")
                && l.ends_with(" 1")),
            "{metrics}"
        );
    }

    // Nothing changed: no request, no mail, no document, no fence, and kv
    // holds the last value put before the cancel.
    assert!(payments.requests().is_empty(), "{:?}", payments.requests());
    let outbox = d.dir.path().join("data/outbox");
    let mails = std::fs::read_dir(&outbox)
        .map(|r| r.count())
        .unwrap_or_default();
    assert_eq!(mails, 0, "nothing in {}", outbox.display());
    let (status, v) = d.call("GET", "/v1/index/docs/probe", None).await;
    assert_eq!(status, 404, "{v}");
    let (_, v) = d.call("GET", "/v1/fences", None).await;
    assert_eq!(v["fences"], json!([]), "{v}");
    let read = d.enqueue("stale", payload(json!({"do": "read"}))).await;
    let r = d.wait_state(&read, "completed", 30).await;
    assert_eq!(
        r["result"],
        json!({"counter": last_ok.to_string(), "probe": null}),
        "kv unchanged since the cancel"
    );
}

/// A SQLite commit that fails (a full disk, an I/O error) stops the ledger
/// for good (issue 20): the enqueue that needed it is refused, the daemon
/// exits non-zero at once (no grace: nothing could finish), and
/// after a restart everything acknowledged is there and nothing else.
#[tokio::test]
async fn a_failed_commit_stops_the_ledger_and_the_daemon_exits() {
    let mut d = Daemon::prepare("[queues.echo]\nplugin = \"echo\"\n", &[("echo", "echo")]);
    let trigger = d.dir.path().join("fail-commits");
    d.env(
        "FAILPOINTS",
        &format!("sqlite::commit=return({})", trigger.display()),
    );
    d.start().await;
    d.wait_plugin("echo").await;
    let kept = d.enqueue("echo", payload(json!({"n": 1}))).await;
    d.wait_state(&kept, "completed", 30).await;

    std::fs::write(&trigger, b"").unwrap();
    let (status, v) = d
        .call(
            "POST",
            "/v1/queues/echo/jobs",
            Some(json!({"payload": {"n": 2}, "id": "lost"})),
        )
        .await;
    assert_eq!(status, 503, "{v}");
    assert_eq!(v["error"]["code"], "storage_unavailable", "{v}");
    let exit = d.wait_exit(Duration::from_secs(30)).await;
    assert!(!exit.success(), "exit status {exit}");
    let log = d.log();
    assert!(log.contains("ledger commit failed"), "{log}");
    assert!(
        log.contains("the daemon exits so that it is restarted"),
        "{log}"
    );

    std::fs::remove_file(&trigger).unwrap();
    d.unset_env("FAILPOINTS");
    d.start().await;
    assert_eq!(d.job(&kept).await["state"], "completed");
    let (status, _) = d.call("GET", "/v1/jobs/lost", None).await;
    assert_eq!(status, 404, "the refused enqueue left nothing");
}
