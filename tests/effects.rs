//! Effects happen once (docs/fences.md), through the real daemon, against a real
//! HTTP server and a real SMTP server on 127.0.0.1.

use crate::servers;
use crate::support;

use serde_json::json;
use servers::{AfterData, Payments, Push, Smtp};
use support::{Daemon, payload};

/// Queue `charge` (charge_customer) and provider `payments` at `base_url`
/// with a request `timeout` such as `"2s"`.
fn charge_queue(base_url: &str, timeout: &str, extra_provider: &str, queue_extra: &str) -> String {
    format!(
        "[queues.charge]\nplugin = \"charge_customer\"\ngrants = {{ http = [\"payments\"] }}\n{queue_extra}\n\
         [http.payments]\nbase_url = \"{base_url}\"\ntimeout = \"{timeout}\"\n\
         headers = {{ Authorization = {{ env = \"KHATA_TEST_PAYMENTS_TOKEN\", prefix = \"Bearer \" }} }}\n{extra_provider}\n"
    )
}

fn order(id: u32) -> serde_json::Value {
    payload(json!({"order_id": id, "amount": 1250, "currency": "EUR", "customer": "cus_7"}))
}

async fn start(config: &str, plugins: &[(&str, &str)]) -> Daemon {
    let mut d = Daemon::prepare(config, plugins);
    d.env("KHATA_TEST_PAYMENTS_TOKEN", "sk_test_42");
    d.start().await;
    for q in ["charge", "welcome", "report", "notify"] {
        if config.contains(&format!("[queues.{q}]")) {
            d.wait_plugin(q).await;
        }
    }
    d
}

#[tokio::test]
async fn a_charge_reaches_the_provider_once_and_is_replayed() {
    let payments = Payments::start().await;
    let config = charge_queue(
        &payments.url(),
        "2s",
        "idempotency_header = \"Idempotency-Key\"",
        "",
    );
    let d = start(&config, &[("charge_customer", "charge_customer")]).await;

    let first = d.enqueue("charge", order(42)).await;
    let j1 = d.wait_state(&first, "completed", 30).await;
    assert_eq!(j1["result"]["replayed"], false, "{j1}");
    assert_eq!(j1["result"]["charge"]["id"], "ch_1");
    // A second job for the same order: the host replays the recorded response.
    let second = d.enqueue("charge", order(42)).await;
    let j2 = d.wait_state(&second, "completed", 30).await;
    assert_eq!(j2["result"]["replayed"], true, "{j2}");
    assert_eq!(j2["result"]["charge"], j1["result"]["charge"]);

    let seen = payments.requests();
    assert_eq!(seen.len(), 1, "one request reached the provider: {seen:?}");
    assert_eq!(seen[0].idempotency_key.as_deref(), Some("order-charge-42"));
    assert_eq!(
        seen[0].authorization.as_deref(),
        Some("Bearer sk_test_42"),
        "the secret comes from the host"
    );
    let token: u64 = seen[0].fencing_token.as_deref().unwrap().parse().unwrap();
    assert_eq!(j1["attempts"][0]["fencing_token"].as_u64(), Some(token));
    assert_eq!(j1["effects"][0]["outcome"], "performed");
    assert_eq!(j2["effects"][0]["outcome"], "replayed");
    assert_eq!(j2["effects"][0]["key"], "order-charge-42");
}

#[tokio::test]
async fn an_unknown_outcome_is_uncertain_under_skip_until_an_operator_resolves_it() {
    let (addr, hits) = servers::black_hole().await;
    let config = charge_queue(
        &format!("http://{addr}"),
        "2s",
        "",
        "max_attempts = 1\non_uncertain = \"skip\"",
    );
    let d = start(&config, &[("charge_customer", "charge_customer")]).await;

    let id = d.enqueue("charge", order(7)).await;
    let j = d.wait_state(&id, "dead", 30).await;
    assert!(
        j["last_error"].as_str().unwrap().contains("uncertain"),
        "{j}"
    );
    assert_eq!(*hits.lock().unwrap(), 1, "the request left once");

    let (status, v) = d.call("GET", "/v1/fences?state=uncertain", None).await;
    assert_eq!(status, 200, "{v}");
    let fences = v["fences"].as_array().unwrap();
    assert_eq!(fences.len(), 1, "{v}");
    assert_eq!(
        (fences[0]["namespace"].as_str(), fences[0]["key"].as_str()),
        (Some("charge"), Some("order-charge-7"))
    );
    let out = d.cli(&["fences", "--state", "uncertain"]);
    assert!(String::from_utf8_lossy(&out.stdout).contains("order-charge-7"));

    // Retrying does not send it again: still uncertain.
    d.cli(&["retry", &id]);
    let j = d.wait_state(&id, "dead", 30).await;
    assert_eq!(j["attempts"].as_array().unwrap().len(), 2);
    assert_eq!(*hits.lock().unwrap(), 1, "skip: never more than once");

    // The operator says it happened: the next attempt replays.
    let out = d.cli(&[
        "fence",
        "resolve",
        "charge",
        "http",
        "order-charge-7",
        "done",
    ]);
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    d.cli(&["retry", &id]);
    let j = d.wait_state(&id, "completed", 30).await;
    assert_eq!(j["result"]["replayed"], true, "{j}");
    assert_eq!(*hits.lock().unwrap(), 1);
    let (_, v) = d.call("GET", "/v1/fences?state=uncertain", None).await;
    assert!(v["fences"].as_array().unwrap().is_empty());
}

#[tokio::test]
async fn on_uncertain_dead_and_repeat() {
    let (addr, hits) = servers::black_hole().await;
    let config = charge_queue(
        &format!("http://{addr}"),
        "2s",
        "",
        "max_attempts = 3\non_uncertain = \"dead\"",
    );
    let d = start(&config, &[("charge_customer", "charge_customer")]).await;
    let id = d.enqueue("charge", order(8)).await;
    let j = d.wait_state(&id, "dead", 30).await;
    assert_eq!(
        j["attempts"].as_array().unwrap().len(),
        1,
        "dead at once, whatever the budget: {j}"
    );
    assert!(
        j["last_error"].as_str().unwrap().contains("on_uncertain"),
        "{j}"
    );
    assert_eq!(*hits.lock().unwrap(), 1);

    let (addr, hits) = servers::black_hole().await;
    let config = charge_queue(
        &format!("http://{addr}"),
        "2s",
        "",
        "max_attempts = 1\non_uncertain = \"repeat\"",
    );
    let d = start(&config, &[("charge_customer", "charge_customer")]).await;
    let id = d.enqueue("charge", order(9)).await;
    d.wait_state(&id, "dead", 30).await;
    assert!(*hits.lock().unwrap() > 1, "repeat: at least once more");
}

#[tokio::test]
async fn welcome_email_is_sent_once_through_the_outbox() {
    let d = start(
        "[queues.welcome]\nplugin = \"welcome_email\"\nnamespace = \"users\"\ngrants = { kv = true, email = true }\n\
         [email]\ntransport = \"outbox\"\nfrom = \"hello@example.com\"\n",
        &[("welcome_email", "welcome_email")],
    )
    .await;
    let user = payload(json!({"user_id": 7, "email": "ada@example.com", "name": "Ada"}));
    let a = d.enqueue("welcome", user.clone()).await;
    let ja = d.wait_state(&a, "completed", 30).await;
    let b = d.enqueue("welcome", user).await;
    let jb = d.wait_state(&b, "completed", 30).await;
    assert_eq!(ja["result"]["replayed"], false);
    assert_eq!(jb["result"]["replayed"], true);
    assert_eq!(ja["result"]["message_id"], jb["result"]["message_id"]);
    let outbox: Vec<_> = std::fs::read_dir(d.dir.path().join("data/outbox"))
        .unwrap()
        .map(|e| e.unwrap().path())
        .filter(|p| p.extension().is_some_and(|e| e == "eml"))
        .collect();
    assert_eq!(outbox.len(), 1, "{outbox:?}");
    let mail = std::fs::read_to_string(&outbox[0]).unwrap();
    assert!(
        mail.contains("ada@example.com")
            && mail.contains(ja["result"]["message_id"].as_str().unwrap())
    );
}

/// The `.eml` files of the daemon's outbox.
#[cfg(feature = "failpoints")]
fn outbox(d: &Daemon) -> Vec<std::path::PathBuf> {
    std::fs::read_dir(d.dir.path().join("data/outbox"))
        .map(|entries| {
            entries
                .map(|e| e.unwrap().path())
                .filter(|p| p.extension().is_some_and(|e| e == "eml"))
                .collect()
        })
        .unwrap_or_default()
}

#[cfg(feature = "failpoints")]
const REPORT_QUEUE: &str = "[queues.report]\nplugin = \"generate_report\"\ngrants = { kv = true, email = true }\n\
     [email]\ntransport = \"outbox\"\nfrom = \"reports@example.com\"\n";

/// generate_report's key is the job's (`<job-id>:report`): a job that runs
/// twice mails once and replays; the same payload under the same job id is
/// one job; under another job id it is another report, mailed again. A job
/// runs twice here because the daemon is killed after the mail, before the
/// job's completion is recorded.
#[cfg(feature = "failpoints")]
#[tokio::test]
async fn generate_report_mails_once_per_job_and_a_rerun_replays() {
    let mut d = Daemon::prepare(REPORT_QUEUE, &[("generate_report", "generate_report")]);
    d.env("FAILPOINTS", "queue::before_finish=1*return(60000)");
    d.start().await;
    d.wait_plugin("report").await;
    let report = json!({"report_id": "r-7", "period": "2025-01", "to": "ops@example.com"});
    let job = json!({"id": "report-r-7", "payload": report});

    let id = d.enqueue("report", job.clone()).await;
    // Held after the mail, before the job's completion: kill -9 there.
    let deadline = std::time::Instant::now() + std::time::Duration::from_secs(30);
    loop {
        let (_, v) = d.call("GET", "/v1/fences", None).await;
        let done = v["fences"].as_array().unwrap().iter().any(|f| {
            f["key"] == "report-r-7:report" && f["kind"] == "email" && f["state"] == "done"
        });
        if done {
            break;
        }
        assert!(std::time::Instant::now() < deadline, "no mail\n{}", d.log());
        tokio::time::sleep(std::time::Duration::from_millis(20)).await;
    }
    d.kill9();
    d.unset_env("FAILPOINTS");
    d.start().await;

    let j = d.wait_state(&id, "completed", 30).await;
    assert_eq!(j["result"]["report_id"], "r-7", "{j}");
    assert_eq!(j["result"]["replayed"], true, "the rerun replays: {j}");
    let outcomes: Vec<_> = j["effects"]
        .as_array()
        .unwrap()
        .iter()
        .map(|e| (e["attempt"].clone(), e["key"].clone(), e["outcome"].clone()))
        .collect();
    assert_eq!(
        outcomes,
        [
            (json!(1), json!("report-r-7:report"), json!("performed")),
            (json!(2), json!("report-r-7:report"), json!("replayed"))
        ]
    );
    let mails = outbox(&d);
    assert_eq!(mails.len(), 1, "one mail for two runs: {mails:?}");
    let mail = std::fs::read_to_string(&mails[0]).unwrap();
    assert!(mail.contains("To: ops@example.com"), "{mail}");
    assert!(mail.contains("Subject: Report r-7: 2025-01"), "{mail}");
    assert!(mail.contains("Covers: 2025-01-01 to 2025-01-31"), "{mail}");
    assert!(mail.contains(j["result"]["message_id"].as_str().unwrap()));

    // The same id again is the same job: nothing runs, nothing is mailed.
    let (status, v) = d.call("POST", "/v1/queues/report/jobs", Some(job)).await;
    assert_eq!((status, &v["deduplicated"]), (200, &json!(true)), "{v}");
    // Another job for the same report is another job's key: mailed again.
    let other = d.enqueue("report", payload(report)).await;
    let jo = d.wait_state(&other, "completed", 30).await;
    assert_eq!(jo["result"]["replayed"], false, "{jo}");
    assert_ne!(jo["result"]["message_id"], j["result"]["message_id"]);
    assert_eq!(outbox(&d).len(), 2);
}

fn notify_queue(base_url: &str, queue_extra: &str) -> String {
    format!(
        "[queues.notify]\nplugin = \"send_notification\"\ngrants = {{ http = [\"push\"], kv = true }}\n{queue_extra}\n\
         [http.push]\nbase_url = \"{base_url}\"\ntimeout = \"2s\"\n"
    )
}

fn notification() -> serde_json::Value {
    payload(json!({"user_id": 7, "message_id": "m-1", "text": "Your order shipped"}))
}

#[tokio::test]
async fn send_notification_pushes_once_per_message_and_is_replayed() {
    let push = Push::start().await;
    let d = start(
        &notify_queue(&push.url(), ""),
        &[("send_notification", "send_notification")],
    )
    .await;

    let first = d.enqueue("notify", notification()).await;
    let j1 = d.wait_state(&first, "completed", 30).await;
    let second = d.enqueue("notify", notification()).await;
    let j2 = d.wait_state(&second, "completed", 30).await;
    assert_ne!(first, second, "two jobs");
    assert_eq!(
        j1["result"],
        json!({"user_id": 7, "message_id": "m-1", "status": 200, "replayed": false})
    );
    assert_eq!(j2["result"]["replayed"], true, "{j2}");
    assert_eq!(j2["result"]["status"], 200, "{j2}");
    assert_eq!(j1["effects"][0]["outcome"], "performed", "{j1}");
    assert_eq!(j2["effects"][0]["outcome"], "replayed", "{j2}");
    assert_eq!(j2["effects"][0]["key"], "notify:m-1");

    let seen = push.requests();
    assert_eq!(seen.len(), 1, "one push reached the provider: {seen:?}");
    assert_eq!(
        seen[0].body,
        json!({"user_id": 7, "text": "Your order shipped"})
    );
    assert_eq!(
        seen[0].idempotency_key, None,
        "push has no idempotency header"
    );
    assert!(seen[0].fencing_token.is_some());
}

#[tokio::test]
async fn send_notification_uncertain_fails_until_an_operator_resolves_it() {
    let (addr, hits) = servers::black_hole().await;
    let d = start(
        &notify_queue(&format!("http://{addr}"), "on_uncertain = \"skip\""),
        &[("send_notification", "send_notification")],
    )
    .await;
    let id = d.enqueue("notify", notification()).await;
    let j = d.wait_state(&id, "dead", 30).await;
    assert_eq!(
        j["attempts"].as_array().unwrap().len(),
        1,
        "dead at once: {j}"
    );
    assert!(
        j["last_error"].as_str().unwrap().contains("uncertain"),
        "{j}"
    );
    assert_eq!(*hits.lock().unwrap(), 1, "sent once, never repeated");

    // The operator learns from the provider that it was delivered.
    let out = d.cli(&["fence", "resolve", "notify", "http", "notify:m-1", "done"]);
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    d.cli(&["retry", &id]);
    let j = d.wait_state(&id, "completed", 30).await;
    assert_eq!(j["result"]["status"], 204, "{j}");
    assert_eq!(j["result"]["replayed"], true, "{j}");
    assert_eq!(*hits.lock().unwrap(), 1);
}

#[tokio::test]
async fn welcome_email_over_real_smtp() {
    let tmp = tempfile::tempdir().unwrap();
    let smtp = Smtp::start(&tmp.path().join("mail"));
    let d = start(
        &format!(
            "[queues.welcome]\nplugin = \"welcome_email\"\ngrants = {{ kv = true, email = true }}\n\
             [email]\ntransport = \"smtp\"\nfrom = \"hello@example.com\"\nhost = \"127.0.0.1\"\nport = {}\ntls = \"none\"\n",
            smtp.port
        ),
        &[("welcome_email", "welcome_email")],
    )
    .await;
    let id = d
        .enqueue(
            "welcome",
            payload(json!({"user_id": 9, "email": "bob@example.com", "name": "Bob"})),
        )
        .await;
    let j = d.wait_state(&id, "completed", 30).await;
    let again = d
        .enqueue(
            "welcome",
            payload(json!({"user_id": 9, "email": "bob@example.com", "name": "Bob"})),
        )
        .await;
    d.wait_state(&again, "completed", 30).await;
    let messages = smtp.messages();
    assert_eq!(messages.len(), 1, "one message reached the SMTP server");
    assert!(
        messages[0].contains(j["result"]["message_id"].as_str().unwrap()),
        "{}",
        messages[0]
    );
    assert!(messages[0].contains("Welcome, Bob!"));
}

/// Queue `welcome` (welcome_email, namespace `welcome`) sending through the
/// SMTP server on `port`.
fn welcome_smtp_queue(port: u16, queue_extra: &str) -> String {
    format!(
        "[queues.welcome]\nplugin = \"welcome_email\"\ngrants = {{ kv = true, email = true }}\n{queue_extra}\n\
         [email]\ntransport = \"smtp\"\nfrom = \"hello@example.com\"\nhost = \"127.0.0.1\"\nport = {port}\ntls = \"none\"\ntimeout = \"5s\"\n"
    )
}

fn welcome_user(user_id: u32) -> serde_json::Value {
    payload(
        json!({"user_id": user_id, "email": format!("u{user_id}@example.com"), "name": format!("U{user_id}")}),
    )
}

/// The `Message-ID` header of a kept message.
fn message_id_of(message: &str) -> &str {
    message
        .lines()
        .find_map(|l| l.strip_prefix("Message-ID: "))
        .unwrap_or_else(|| panic!("no Message-ID in {message}"))
        .trim()
}

/// The job's effect records as (attempt, key, outcome).
fn effect_outcomes(j: &serde_json::Value) -> Vec<(u64, String, String)> {
    j["effects"]
        .as_array()
        .unwrap()
        .iter()
        .map(|e| {
            (
                e["attempt"].as_u64().unwrap(),
                e["key"].as_str().unwrap().to_owned(),
                e["outcome"].as_str().unwrap().to_owned(),
            )
        })
        .collect()
}

/// The fences listed by `GET /v1/fences?state=STATE` as (namespace, kind, key, job_id).
async fn fences_in(d: &Daemon, state: &str) -> Vec<(String, String, String, String)> {
    let (status, v) = d
        .call("GET", &format!("/v1/fences?state={state}"), None)
        .await;
    assert_eq!(status, 200, "{v}");
    v["fences"]
        .as_array()
        .unwrap()
        .iter()
        .map(|f| {
            let s = |k: &str| f[k].as_str().unwrap().to_owned();
            (s("namespace"), s("kind"), s("key"), s("job_id"))
        })
        .collect()
}

/// One row of the SMTP drop table: a server that keeps each message and
/// drops the connection instead of answering the final dot, under one
/// `on_uncertain` policy, and what the job, its effect records, the server's
/// mailbox and the fence list must show afterwards.
struct SmtpDrop {
    /// The server's behaviour after DATA.
    drop: AfterData,
    /// Extra queue keys: `max_attempts`, `on_uncertain`, `backoff`.
    queue: &'static str,
    /// The user of the job (and of its key `welcome:<user>`).
    user: u32,
    /// The state the job ends in.
    ends: &'static str,
    /// Each attempt's outcome, in order.
    attempts: &'static [&'static str],
    /// Each effect record's outcome, one per attempt.
    effects: &'static [&'static str],
    /// The copies the server kept.
    messages: usize,
    /// The state of the email fence afterwards.
    fence: &'static str,
}

impl SmtpDrop {
    /// Runs the row and checks everything it names; returns the daemon, the
    /// SMTP server, the job's id and its final record for what a row checks
    /// beyond the table.
    async fn run(self) -> (Daemon, Smtp, String, serde_json::Value, tempfile::TempDir) {
        let tmp = tempfile::tempdir().unwrap();
        let smtp = Smtp::start_with(
            &tmp.path().join("mail"),
            std::time::Duration::ZERO,
            self.drop,
        );
        let d = start(
            &welcome_smtp_queue(smtp.port, self.queue),
            &[("welcome_email", "welcome_email")],
        )
        .await;
        let id = d.enqueue("welcome", welcome_user(self.user)).await;
        let j = d.wait_state(&id, self.ends, 30).await;
        let attempts: Vec<&str> = j["attempts"]
            .as_array()
            .unwrap()
            .iter()
            .map(|a| a["outcome"].as_str().unwrap())
            .collect();
        assert_eq!(attempts, self.attempts, "{j}");
        let key = format!("welcome:{}", self.user);
        let effects: Vec<_> = self
            .effects
            .iter()
            .zip(1..)
            .map(|(outcome, attempt)| (attempt, key.clone(), (*outcome).to_owned()))
            .collect();
        assert_eq!(effect_outcomes(&j), effects, "{j}");
        assert_eq!(
            smtp.messages().len(),
            self.messages,
            "{:#?}",
            smtp.messages()
        );
        assert_eq!(
            fences_in(&d, self.fence).await,
            [("welcome".into(), "email".into(), key, id.clone())],
            "the fence is {}",
            self.fence
        );
        if self.fence != "uncertain" {
            assert!(fences_in(&d, "uncertain").await.is_empty());
        }
        (d, smtp, id, j, tmp)
    }
}

/// `skip`: whether the dropped message was sent is unknown, SMTP is not
/// idempotent and cannot be asked, so the fence is `uncertain`, listed for an
/// operator, and nothing is ever sent again; welcome_email's `?` makes
/// `uncertain` a permanent failure, so the job is dead at once whatever its
/// budget. Once the operator resolves the fence `done`, a retry replays the
/// receipt with the Message-ID the server kept.
#[tokio::test]
async fn smtp_drop_after_data_under_skip_is_uncertain_and_never_sent_again() {
    let (d, smtp, id, j, _tmp) = SmtpDrop {
        drop: AfterData::DropAlways,
        queue: "max_attempts = 3\non_uncertain = \"skip\"",
        user: 21,
        ends: "dead",
        attempts: &["failed"],
        effects: &["refused:uncertain"],
        messages: 1,
        fence: "uncertain",
    }
    .run()
    .await;
    assert!(
        j["last_error"]
            .as_str()
            .unwrap()
            .starts_with("effect uncertain:"),
        "{j}"
    );

    // Another job for the same user meets the uncertain fence: nothing is sent.
    let again = d.enqueue("welcome", welcome_user(21)).await;
    let ja = d.wait_state(&again, "dead", 30).await;
    assert_eq!(
        effect_outcomes(&ja),
        [(1, "welcome:21".into(), "refused:uncertain".into())]
    );
    assert_eq!(smtp.messages().len(), 1, "skip: never a second send");

    let out = d.cli(&["fence", "resolve", "welcome", "email", "welcome:21", "done"]);
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    d.cli(&["retry", &id]);
    let j = d.wait_state(&id, "completed", 30).await;
    assert_eq!(j["result"]["replayed"], true, "{j}");
    let messages = smtp.messages();
    assert_eq!(messages.len(), 1);
    assert_eq!(
        j["result"]["message_id"].as_str().unwrap(),
        message_id_of(&messages[0])
    );
    assert!(fences_in(&d, "uncertain").await.is_empty());
}

/// `repeat` against one drop: the daemon sends the message again, with the
/// same Message-ID, in the same call (one attempt: the resend cannot be a
/// retry); the handler never sees the unknown outcome. The server ends with
/// two copies: the one it kept without answering and the resend it answered
/// (at least once).
#[tokio::test]
async fn smtp_drop_after_data_under_repeat_sends_again_with_the_same_message_id() {
    let (_d, smtp, _id, j, _tmp) = SmtpDrop {
        drop: AfterData::DropFirst(1),
        queue: "max_attempts = 1\non_uncertain = \"repeat\"",
        user: 22,
        ends: "completed",
        attempts: &["completed"],
        effects: &["performed"],
        messages: 2,
        fence: "done",
    }
    .run()
    .await;
    assert_eq!(j["result"]["replayed"], false, "{j}");
    let message_id = j["result"]["message_id"].as_str().unwrap();
    for m in &smtp.messages() {
        assert_eq!(
            message_id_of(m),
            message_id,
            "the same Message-ID on every try"
        );
        assert!(m.contains("To: u22@example.com"), "{m}");
    }
}

/// `repeat` against a server that never answers: one call sends at most 3
/// times, then returns `transient` and leaves the fence `started`; the next
/// attempt starts over. Two attempts, six copies, and a dead job whose fence
/// is still `started`.
#[tokio::test]
async fn smtp_drop_always_under_repeat_sends_three_times_per_call() {
    let (_d, _smtp, _id, j, _tmp) = SmtpDrop {
        drop: AfterData::DropAlways,
        queue: "max_attempts = 2\non_uncertain = \"repeat\"\nbackoff = { initial = \"10ms\", max = \"20ms\" }",
        user: 23,
        ends: "dead",
        attempts: &["retry", "retry"],
        effects: &["refused:transient", "refused:transient"],
        messages: 6,
        fence: "started",
    }
    .run()
    .await;
    assert!(
        j["last_error"]
            .as_str()
            .unwrap()
            .contains("stayed unknown after 3 tries"),
        "{j}"
    );
}

/// `dead`: the fence becomes `uncertain` and the job goes dead at once with
/// the policy's message, however many attempts it had left; sent once, not
/// repeated.
#[tokio::test]
async fn smtp_drop_after_data_under_dead_dead_letters_the_job() {
    let (_d, _smtp, _id, j, _tmp) = SmtpDrop {
        drop: AfterData::DropAlways,
        queue: "max_attempts = 5\non_uncertain = \"dead\"",
        user: 24,
        ends: "dead",
        attempts: &["failed"],
        effects: &["refused:uncertain"],
        messages: 1,
        fence: "uncertain",
    }
    .run()
    .await;
    assert_eq!(
        j["last_error"],
        "the outcome of effect welcome/email/welcome:24 is unknown and the queue's on_uncertain policy is `dead`",
        "{j}"
    );
}

fn jitter_ms(lo: u64, hi: u64) -> u64 {
    let nanos = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .unwrap()
        .subsec_nanos();
    lo + u64::from(nanos) % (hi - lo)
}

/// Enqueues `orders` charges, kills the daemon three times at random
/// moments while they run, and waits until every job has ended.
async fn charge_through_crashes(d: &mut Daemon, orders: u64) -> Vec<serde_json::Value> {
    for start in (0..orders).step_by(500) {
        let jobs: Vec<_> = (start..(start + 500).min(orders))
            .map(|i| json!({"id": format!("order-{i}"), "payload": {"order_id": i, "amount": 100, "currency": "EUR", "customer": "c"}}))
            .collect();
        let (status, v) = d
            .call(
                "POST",
                "/v1/queues/charge/jobs/batch",
                Some(json!({"jobs": jobs})),
            )
            .await;
        assert_eq!(status, 200, "{v}");
    }
    for _ in 0..3 {
        tokio::time::sleep(std::time::Duration::from_millis(jitter_ms(100, 600))).await;
        d.kill9();
        d.start().await;
    }
    let deadline = std::time::Instant::now() + std::time::Duration::from_secs(120);
    loop {
        let c = &d.queue("charge").await["counts"];
        let ended = c["completed"].as_u64().unwrap() + c["dead"].as_u64().unwrap();
        if ended == orders {
            break;
        }
        assert!(
            std::time::Instant::now() < deadline,
            "jobs did not end: {c}\n{}",
            d.log()
        );
        tokio::time::sleep(std::time::Duration::from_millis(100)).await;
    }
    let mut jobs = Vec::new();
    for i in 0..orders {
        jobs.push(d.job(&format!("order-{i}")).await);
    }
    jobs
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn idempotent_provider_charges_each_order_once_across_kill_nine() {
    let payments = Payments::start_with_delay(std::time::Duration::from_millis(20)).await;
    let config = charge_queue(
        &payments.url(),
        "2s",
        "idempotency_header = \"Idempotency-Key\"",
        "concurrency = 16\nmax_attempts = 20\nbackoff = { initial = \"10ms\", max = \"50ms\" }",
    );
    let mut d = start(&config, &[("charge_customer", "charge_customer")]).await;
    let orders = 600;
    let jobs = charge_through_crashes(&mut d, orders).await;
    for (i, j) in jobs.iter().enumerate() {
        assert_eq!(j["state"], "completed", "order {i}: {j}");
    }
    assert_eq!(payments.charges(), orders as usize, "one charge per order");
    for r in payments.requests() {
        let order = r.body["order_id"].as_u64().unwrap();
        assert_eq!(
            r.idempotency_key,
            Some(format!("order-charge-{order}")),
            "every request carries its order's key"
        );
    }
    let repeats = payments.requests().len() - orders as usize;
    eprintln!(
        "{repeats} requests repeated with the same key after a crash (deduplicated by the provider)"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn non_idempotent_provider_never_charges_twice_under_skip() {
    let payments = Payments::start_with_delay(std::time::Duration::from_millis(20)).await;
    let config = charge_queue(
        &payments.url(),
        "2s",
        "",
        "concurrency = 16\nmax_attempts = 20\non_uncertain = \"skip\"\nbackoff = { initial = \"10ms\", max = \"50ms\" }",
    );
    let mut d = start(&config, &[("charge_customer", "charge_customer")]).await;
    let orders = 600;
    let jobs = charge_through_crashes(&mut d, orders).await;
    let (_, v) = d
        .call("GET", "/v1/fences?state=uncertain&limit=1000", None)
        .await;
    let uncertain: std::collections::HashSet<String> = v["fences"]
        .as_array()
        .unwrap()
        .iter()
        .map(|f| f["key"].as_str().unwrap().to_owned())
        .collect();
    for (i, j) in jobs.iter().enumerate() {
        let sent = payments.requests_for(i as u64);
        assert!(sent <= 1, "order {i} was charged {sent} times: {j}");
        let key = format!("order-charge-{i}");
        match j["state"].as_str().unwrap() {
            "completed" => assert_eq!(sent, 1, "order {i} completed without its charge: {j}"),
            "dead" => assert!(
                uncertain.contains(&key),
                "order {i} is dead but its fence is not uncertain: {j}"
            ),
            other => panic!("order {i} ended {other}: {j}"),
        }
    }
    eprintln!(
        "{} orders uncertain after three kill -9, none charged twice",
        uncertain.len()
    );
}

#[tokio::test]
async fn refusals_key_reused_and_denied() {
    // key-reused: the same user welcomed again with another message.
    let d = start(
        "[queues.welcome]\nplugin = \"welcome_email\"\ngrants = { kv = true, email = true }\nmax_attempts = 1\n",
        &[("welcome_email", "welcome_email")],
    )
    .await;
    let a = d
        .enqueue(
            "welcome",
            payload(json!({"user_id": 3, "email": "c@example.com", "name": "Cy"})),
        )
        .await;
    d.wait_state(&a, "completed", 30).await;
    let b = d
        .enqueue(
            "welcome",
            payload(json!({"user_id": 3, "email": "c@example.com", "name": "Cyrus"})),
        )
        .await;
    let j = d.wait_state(&b, "dead", 30).await;
    assert_eq!(j["effects"][0]["outcome"], "refused:key-reused", "{j}");

    // denied: the queue is granted another provider than the one called.
    let payments = Payments::start().await;
    let config = format!(
        "[queues.charge]\nplugin = \"charge_customer\"\ngrants = {{ http = [\"other\"] }}\nmax_attempts = 1\n\
         [http.other]\nbase_url = \"{}\"\n",
        payments.url()
    );
    let d = start(&config, &[("charge_customer", "charge_customer")]).await;
    let id = d.enqueue("charge", order(1)).await;
    let j = d.wait_state(&id, "dead", 30).await;
    assert!(
        j["last_error"]
            .as_str()
            .unwrap()
            .contains("not granted http provider"),
        "{j}"
    );
    assert_eq!(j["effects"][0]["outcome"], "refused:denied", "{j}");
    assert!(payments.requests().is_empty());
}

#[tokio::test]
async fn a_500_is_recorded_and_replayed_not_resent() {
    let payments = Payments::start_with(servers::Behaviour {
        status: axum::http::StatusCode::INTERNAL_SERVER_ERROR,
        ..Default::default()
    })
    .await;
    let config = charge_queue(
        &payments.url(),
        "2s",
        "idempotency_header = \"Idempotency-Key\"",
        "max_attempts = 1",
    );
    let d = start(&config, &[("charge_customer", "charge_customer")]).await;
    let id = d.enqueue("charge", order(5)).await;
    let j = d.wait_state(&id, "dead", 30).await;
    assert!(j["last_error"].as_str().unwrap().contains("500"), "{j}");
    d.cli(&["retry", &id]);
    let j = d.wait_state(&id, "dead", 30).await;
    assert_eq!(j["attempts"].as_array().unwrap().len(), 2);
    assert_eq!(j["effects"][1]["outcome"], "replayed", "{j}");
    assert_eq!(
        payments.requests().len(),
        1,
        "a received 500 is done: never sent again"
    );
}

#[tokio::test]
async fn connection_refused_releases_the_fence_and_retries() {
    let closed = format!("http://127.0.0.1:{}", support::free_port());
    let config = charge_queue(
        &closed,
        "2s",
        "idempotency_header = \"Idempotency-Key\"",
        "max_attempts = 3\nbackoff = { initial = \"10ms\", max = \"20ms\" }",
    );
    let d = start(&config, &[("charge_customer", "charge_customer")]).await;
    let id = d.enqueue("charge", order(6)).await;
    let j = d.wait_state(&id, "dead", 30).await;
    assert_eq!(j["attempts"].as_array().unwrap().len(), 3, "retried: {j}");
    assert!(
        j["attempts"]
            .as_array()
            .unwrap()
            .iter()
            .all(|a| a["outcome"] == "retry"),
        "{j}"
    );
    assert!(
        j["effects"]
            .as_array()
            .unwrap()
            .iter()
            .all(|e| e["outcome"] == "refused:transient"),
        "{j}"
    );
    let (_, v) = d.call("GET", "/v1/fences", None).await;
    assert!(v["fences"].as_array().unwrap().is_empty(), "released: {v}");
}

#[tokio::test]
async fn a_slow_answer_is_unknown_and_the_idempotent_provider_is_asked_again_with_the_same_key() {
    let payments = Payments::start_with(servers::Behaviour {
        first_delay: Some(std::time::Duration::from_secs(5)),
        ..Default::default()
    })
    .await;
    let config = charge_queue(
        &payments.url(),
        "1s",
        "idempotency_header = \"Idempotency-Key\"",
        "",
    );
    let d = start(&config, &[("charge_customer", "charge_customer")]).await;
    let id = d.enqueue("charge", order(11)).await;
    let j = d.wait_state(&id, "completed", 30).await;
    let seen = payments.requests();
    assert_eq!(seen.len(), 2, "asked again after the timeout: {seen:?}");
    assert!(
        seen.iter()
            .all(|r| r.idempotency_key.as_deref() == Some("order-charge-11"))
    );
    assert_eq!(
        payments.charges(),
        1,
        "the provider deduplicated: one charge"
    );
    assert_eq!(j["result"]["charge"]["id"], "ch_1", "{j}");
}

#[tokio::test]
async fn a_fence_held_by_a_running_attempt_is_in_progress_for_another_job() {
    let payments = Payments::start_with(servers::Behaviour {
        first_delay: Some(std::time::Duration::from_millis(1500)),
        ..Default::default()
    })
    .await;
    let config = charge_queue(
        &payments.url(),
        "5s",
        "idempotency_header = \"Idempotency-Key\"",
        // The second job retries while the first holds the fence (1.5 s):
        // a budget of 100 attempts at most 200 ms apart outlasts it.
        "concurrency = 2\nmax_attempts = 100\nbackoff = { initial = \"100ms\", max = \"200ms\" }",
    );
    let d = start(&config, &[("charge_customer", "charge_customer")]).await;
    let first = d.enqueue("charge", order(12)).await;
    d.wait_state(&first, "active", 30).await;
    let second = d.enqueue("charge", order(12)).await;
    let j = d.wait_state(&second, "completed", 30).await;
    let outcomes: Vec<_> = j["effects"]
        .as_array()
        .unwrap()
        .iter()
        .map(|e| e["outcome"].as_str().unwrap().to_owned())
        .collect();
    assert_eq!(
        outcomes.first().map(String::as_str),
        Some("refused:in-progress"),
        "{j}"
    );
    assert_eq!(outcomes.last().map(String::as_str), Some("replayed"), "{j}");
    d.wait_state(&first, "completed", 30).await;
    assert_eq!(payments.requests().len(), 1);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn welcome_emails_through_three_kill_nine_at_most_one_per_user() {
    let tmp = tempfile::tempdir().unwrap();
    let smtp = Smtp::start_with_delay(
        &tmp.path().join("mail"),
        std::time::Duration::from_millis(10),
    );
    let config = format!(
        "[queues.welcome]\nplugin = \"welcome_email\"\ngrants = {{ kv = true, email = true }}\nconcurrency = 16\n\
         max_attempts = 20\nbackoff = {{ initial = \"10ms\", max = \"50ms\" }}\n\
         [email]\ntransport = \"smtp\"\nfrom = \"hello@example.com\"\nhost = \"127.0.0.1\"\nport = {}\n",
        smtp.port
    );
    let mut d = start(&config, &[("welcome_email", "welcome_email")]).await;
    let users = 500u64;
    let jobs: Vec<_> = (0..users)
        .map(|u| json!({"id": format!("welcome-{u}"), "payload": {"user_id": u, "email": format!("u{u}@example.com"), "name": format!("U{u}")}}))
        .collect();
    let (status, v) = d
        .call(
            "POST",
            "/v1/queues/welcome/jobs/batch",
            Some(json!({"jobs": jobs})),
        )
        .await;
    assert_eq!(status, 200, "{v}");
    for _ in 0..3 {
        tokio::time::sleep(std::time::Duration::from_millis(jitter_ms(200, 700))).await;
        d.kill9();
        d.start().await;
    }
    let wait_ended = async |d: &Daemon| {
        let deadline = std::time::Instant::now() + std::time::Duration::from_secs(180);
        loop {
            let c = &d.queue("welcome").await["counts"];
            if c["completed"].as_u64().unwrap() + c["dead"].as_u64().unwrap() == users {
                return;
            }
            assert!(
                std::time::Instant::now() < deadline,
                "jobs did not end: {c}\n{}",
                d.log()
            );
            tokio::time::sleep(std::time::Duration::from_millis(100)).await;
        }
    };
    wait_ended(&d).await;
    let per_user = |smtp: &Smtp| {
        let mut n = vec![0usize; users as usize];
        for m in smtp.messages() {
            let u: usize = m
                .split("To: u")
                .nth(1)
                .and_then(|r| r.split('@').next())
                .and_then(|x| x.parse().ok())
                .expect("a To header");
            n[u] += 1;
        }
        n
    };
    let sent = per_user(&smtp);
    assert!(sent.iter().all(|n| *n <= 1), "a user got two emails");
    let (_, v) = d
        .call("GET", "/v1/fences?state=uncertain&limit=1000", None)
        .await;
    let uncertain = v["fences"].as_array().unwrap().clone();
    for u in 0..users {
        let j = d.job(&format!("welcome-{u}")).await;
        if j["state"] == "completed" {
            assert_eq!(
                sent[u as usize], 1,
                "user {u} completed without an email: {j}"
            );
        } else {
            assert!(
                uncertain.iter().any(|f| f["key"] == format!("welcome:{u}")),
                "user {u} is dead but not uncertain: {j}"
            );
        }
    }
    // The operator checks the mail server for each uncertain message and
    // resolves accordingly; then retries the dead jobs.
    let messages = smtp.messages().join("\n");
    for f in &uncertain {
        let key = f["key"].as_str().unwrap();
        let user: u64 = key.trim_start_matches("welcome:").parse().unwrap();
        let delivered = sent[user as usize] == 1;
        let outcome = if delivered { "done" } else { "not-done" };
        let (status, v) = d
            .call("POST", "/v1/fences/resolve", Some(json!({"namespace": "welcome", "kind": "email", "key": key, "outcome": outcome})))
            .await;
        assert_eq!(status, 200, "{v}");
        d.call("POST", &format!("/v1/jobs/welcome-{user}/retry"), None)
            .await;
    }
    assert!(!messages.is_empty());
    wait_ended(&d).await;
    let sent = per_user(&smtp);
    for u in 0..users {
        let j = d.job(&format!("welcome-{u}")).await;
        assert_eq!(j["state"], "completed", "{j}");
        assert_eq!(sent[u as usize], 1, "user {u} has exactly one email");
    }
    eprintln!(
        "{} uncertain after three kill -9; resolved by looking at the mail server",
        uncertain.len()
    );
}

/// What a guest can abuse through email (issue 19): a From that `[email]`
/// does not allow is refused (`denied`), so are more than 50 recipients and
/// a subject past 998 bytes (`invalid`); a guest that keeps calling with a
/// refused message gets 32 refusals recorded on its attempt and one record
/// saying the rest were not, and a refused key is recorded cut to 1 KiB.
#[tokio::test]
async fn email_senders_recipients_and_refusals_are_bounded() {
    let d = Daemon::start_new(
        "[queues.stale]\nplugin = \"stale\"\nmax_attempts = 1\n\
         grants = { kv = true, index = [\"docs\"], email = true, http = [\"payments\"] }\n\
         [email]\ntransport = \"outbox\"\nfrom = \"hello@example.com\"\nsenders = [\"Reports@Example.com\"]\n\
         [http.payments]\nbase_url = \"http://127.0.0.1:9\"\n",
        &[("stale", "stale")],
    )
    .await;
    d.wait_plugin("stale").await;
    let send = async |mail: serde_json::Value| {
        let mut body = mail;
        body["do"] = json!("mail");
        let id = d.enqueue("stale", payload(body)).await;
        d.wait_state(&id, "completed", 30).await
    };
    let to = json!(["ada@example.com"]);
    for (from, ok) in [
        ("hello@example.com", true),
        ("Reports <reports@example.com>", true),
        ("ceo@example.com", false),
    ] {
        let j =
            send(json!({"key": format!("from-{from}"), "to": to, "subject": "s", "from": from}))
                .await;
        let expected = if ok { json!([]) } else { json!(["denied"]) };
        assert_eq!(j["result"]["errors"], expected, "{from}: {j}");
    }
    let many: Vec<String> = (0..51).map(|i| format!("u{i}@example.com")).collect();
    let j = send(json!({"key": "many", "to": many, "subject": "s"})).await;
    assert_eq!(j["result"]["errors"], json!(["invalid"]), "{j}");
    let j = send(json!({"key": "long", "to": to, "subject": "x".repeat(999)})).await;
    assert_eq!(j["result"]["errors"], json!(["invalid"]), "{j}");

    // 200 refused calls: 32 recorded, then one record of the rest.
    let j = send(
        json!({"key": "flood", "to": to, "subject": "s", "from": "ceo@example.com", "times": 200}),
    )
    .await;
    assert_eq!(j["result"]["errors"].as_array().unwrap().len(), 200, "{j}");
    let effects = j["effects"].as_array().unwrap();
    assert_eq!(effects.len(), 33, "{j}");
    assert!(
        effects[..32]
            .iter()
            .all(|e| e["outcome"] == "refused:denied"),
        "{j}"
    );
    assert_eq!(effects[32]["kind"], "refusals", "{j}");
    assert_eq!(effects[32]["outcome"], "not-recorded", "{j}");

    // A refused key of 5,000 bytes is recorded cut to 1,024.
    let j = send(json!({"key": "k".repeat(5000), "to": to, "subject": "s"})).await;
    assert_eq!(j["result"]["errors"], json!(["invalid"]), "{j}");
    assert_eq!(j["effects"][0]["key"].as_str().unwrap().len(), 1024, "{j}");
}
