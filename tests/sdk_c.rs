//! The C examples (`plugins/c`), built with `sdk/c`'s `khata-build-c` by
//! `scripts/build-plugins`, run through the real daemon: `echo_c` needs no
//! grant and returns its payload; `welcome_email_c`, the twin of the Rust
//! `welcome_email`, sends one email when its job runs twice, fails a bad
//! payload naming the field, and `khata verify` finds it clean.

mod servers;
mod support;

use std::path::Path;
use std::process::Command;

use serde_json::{Value, json};
use servers::Smtp;
use support::{Daemon, KHATA, guest, payload};

fn welcome_queue(smtp_port: u16) -> String {
    format!(
        "[queues.welcome]\nplugin = \"welcome_email\"\ngrants = {{ kv = true, email = true }}\nmax_attempts = 1\n\
         [email]\ntransport = \"smtp\"\nfrom = \"hello@example.com\"\nhost = \"127.0.0.1\"\nport = {smtp_port}\ntls = \"none\"\ntimeout = \"5s\"\n"
    )
}

#[tokio::test]
async fn c_echo_needs_no_grant_and_returns_its_payload() {
    let d = Daemon::start_new(
        "[queues.echo]\nplugin = \"echo\"\nmax_attempts = 1\n",
        &[("echo", "echo_c")],
    )
    .await;
    d.wait_plugin("echo").await;
    let body = json!({"hello": "wörld", "n": [1, 2.5, null], "nested": {"ok": true}});
    let id = d.enqueue("echo", payload(body.clone())).await;
    let j = d.wait_state(&id, "completed", 60).await;
    assert_eq!(j["result"], body, "{j}");
}

#[tokio::test]
async fn c_welcome_email_is_sent_once_when_run_twice() {
    let tmp = tempfile::tempdir().unwrap();
    let smtp = Smtp::start(&tmp.path().join("mail"));
    let d = Daemon::start_new(
        &welcome_queue(smtp.port),
        &[("welcome_email", "welcome_email_c")],
    )
    .await;
    d.wait_plugin("welcome").await;
    let user = json!({"user_id": 9, "email": "bob@example.com", "name": "Bob"});

    let first = d.enqueue("welcome", payload(user.clone())).await;
    let j1 = d.wait_state(&first, "completed", 60).await;
    assert_eq!(j1["result"]["user_id"], 9, "{j1}");
    assert_eq!(j1["result"]["replayed"], false, "{j1}");
    let second = d.enqueue("welcome", payload(user)).await;
    let j2 = d.wait_state(&second, "completed", 60).await;
    assert_eq!(j2["result"]["replayed"], true, "{j2}");
    assert_eq!(j2["result"]["message_id"], j1["result"]["message_id"]);

    let messages = smtp.messages();
    assert_eq!(messages.len(), 1, "one message reached the SMTP server");
    let message_id = j1["result"]["message_id"].as_str().unwrap();
    assert!(messages[0].contains(message_id), "{}", messages[0]);
    assert!(
        messages[0].contains("Subject: Welcome, Bob!"),
        "{}",
        messages[0]
    );
    assert!(
        messages[0].contains("To: bob@example.com"),
        "{}",
        messages[0]
    );
    assert!(messages[0].contains("Hello Bob,"), "{}", messages[0]);

    // Another message under the same user's key is refused, naming the user.
    let other = d
        .enqueue(
            "welcome",
            payload(json!({"user_id": 9, "email": "bob@example.com", "name": "Robert"})),
        )
        .await;
    let j = d.wait_state(&other, "dead", 60).await;
    let error = j["last_error"].as_str().unwrap();
    assert!(
        error.starts_with("user 9 was already welcomed with a different message (key welcome:9)"),
        "{j}"
    );

    // A bad payload fails naming the field, and sends nothing.
    for (bad, expected) in [
        (
            json!({"user_id": -1, "email": "x@example.com", "name": "X"}),
            "bad payload: user_id must be a non-empty string or a non-negative integer, got -1",
        ),
        (
            json!({"user_id": "u-1", "name": "X"}),
            "bad payload: missing field `email`",
        ),
        (
            json!({"user_id": "u-1", "email": 5, "name": "X"}),
            "bad payload: email must be a string, got 5",
        ),
    ] {
        let id = d.enqueue("welcome", payload(bad)).await;
        let j = d.wait_state(&id, "dead", 60).await;
        assert_eq!(j["last_error"], expected, "{j}");
    }
    assert_eq!(smtp.messages().len(), 1, "nothing more was sent");
}

/// Runs `khata verify PLUGIN --payload P --json`; the exit code and report.
fn verify_json(plugin: &Path, payload: &Value) -> (i32, Value) {
    let out = Command::new(KHATA)
        .args([
            "verify",
            plugin.to_str().unwrap(),
            "--payload",
            &payload.to_string(),
            "--json",
        ])
        .output()
        .expect("run khata verify");
    let report: Value = serde_json::from_slice(&out.stdout).unwrap_or_else(|e| {
        panic!(
            "not a JSON report ({e}): stdout {} stderr {}",
            String::from_utf8_lossy(&out.stdout),
            String::from_utf8_lossy(&out.stderr)
        )
    });
    (out.status.code().expect("exit code"), report)
}

/// The (kind, key) effects of the report's run at `index`.
fn effects(report: &Value, index: usize) -> Vec<(String, String)> {
    report["runs"][index]["effects"]
        .as_array()
        .unwrap_or_else(|| panic!("no run {index}: {report:#}"))
        .iter()
        .map(|c| {
            (
                c["kind"].as_str().unwrap().to_owned(),
                c["key"].as_str().unwrap().to_owned(),
            )
        })
        .collect()
}

#[test]
fn the_c_examples_verify_clean() {
    let (code, report) = verify_json(
        &guest("welcome_email_c"),
        &json!({"user_id": 7, "email": "ada@example.com", "name": "Ada"}),
    );
    assert_eq!(code, 0, "{report:#}");
    assert_eq!(report["findings"], json!([]), "{report:#}");
    let expected = vec![
        ("email".to_owned(), "welcome:7".to_owned()),
        ("kv".to_owned(), "welcomed:7".to_owned()),
    ];
    assert_eq!(effects(&report, 0), expected, "the clean run's effects");
    let runs = report["runs"].as_array().unwrap();
    // Clean, a cut and a redelivery at each crash point (three for the
    // email, two for kv), fresh.
    assert_eq!(runs.len(), 1 + 2 * (3 + 2) + 1, "{report:#}");
    assert_eq!(
        effects(&report, runs.len() - 1),
        expected,
        "the fresh run's effects"
    );

    let (code, report) = verify_json(&guest("echo_c"), &json!({"hello": "world"}));
    assert_eq!(code, 0, "{report:#}");
    assert_eq!(report["findings"], json!([]), "{report:#}");
    assert_eq!(effects(&report, 0), vec![], "echo has no effects");
}
