//! `khata verify` and `khata new`, through the real binary: the example
//! plugins verify clean; each flaw of the `unstable` guest is found exactly;
//! bad input exits 2 naming what is wrong; a project scaffolded in each
//! language builds with its toolchain, passes its own tests and verifies
//! clean.

use crate::support;

use std::path::{Path, PathBuf};
use std::process::{Command, Output};

use serde_json::{Value, json};
use support::{KHATA, guest};

fn workspace() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR"))
        .parent()
        .expect("workspace root")
        .to_path_buf()
}

fn khata(args: &[&str]) -> Output {
    Command::new(KHATA)
        .args(args)
        .current_dir(workspace())
        // The default code cache, kept in the build tree, not the home.
        .env("XDG_CACHE_HOME", workspace().join("target/test-cache"))
        .output()
        .expect("run khata")
}

fn text(bytes: &[u8]) -> String {
    String::from_utf8_lossy(bytes).into_owned()
}

/// Runs `khata verify PLUGIN --payload P [extra] --json`; the exit code and report.
fn verify_json(plugin: &Path, payload: &Value, extra: &[&str]) -> (i32, Value) {
    let plugin = plugin.to_str().expect("utf-8 path");
    let payload = payload.to_string();
    let mut args = vec!["verify", plugin, "--payload", &payload, "--json"];
    args.extend_from_slice(extra);
    let out = khata(&args);
    let report: Value = serde_json::from_slice(&out.stdout).unwrap_or_else(|e| {
        panic!(
            "not a JSON report ({e}): stdout {} stderr {}",
            text(&out.stdout),
            text(&out.stderr)
        )
    });
    (out.status.code().expect("exit code"), report)
}

fn finding_kinds(report: &Value) -> Vec<(String, Value)> {
    report["findings"]
        .as_array()
        .expect("findings")
        .iter()
        .map(|f| (f["kind"].as_str().unwrap().to_owned(), f["effect"].clone()))
        .collect()
}

fn finding<'a>(report: &'a Value, kind: &str) -> &'a Value {
    report["findings"]
        .as_array()
        .unwrap()
        .iter()
        .find(|f| f["kind"] == kind)
        .unwrap_or_else(|| panic!("no {kind} finding in {report:#}"))
}

/// The run names in order, and each run's (kind, key) calls.
fn runs(report: &Value) -> Vec<(String, Vec<(String, String)>)> {
    report["runs"]
        .as_array()
        .unwrap()
        .iter()
        .map(|r| {
            let calls = r["effects"]
                .as_array()
                .unwrap()
                .iter()
                .map(|c| {
                    assert_eq!(c["fingerprint"].as_str().unwrap().len(), 16, "{c}");
                    (
                        c["kind"].as_str().unwrap().to_owned(),
                        c["key"].as_str().unwrap().to_owned(),
                    )
                })
                .collect();
            (r["name"].as_str().unwrap().to_owned(), calls)
        })
        .collect()
}

/// The compiled plugin is kept in the code cache: a second verify of the
/// same component reads it back instead of compiling; `--no-code-cache`
/// keeps nothing.
#[test]
fn a_second_verify_reads_the_compiled_plugin_from_the_code_cache() {
    let cache = tempfile::tempdir().unwrap();
    let dir = cache.path().join("cc");
    let dir = dir.to_str().unwrap();
    let echo = guest("echo");
    let payload = json!({"n": 1});
    let with_cache = ["--code-cache", dir];
    let (code, first) = verify_json(&echo, &payload, &with_cache);
    assert_eq!(
        (code, first["code"].as_str()),
        (0, Some("compiled")),
        "{first:#}"
    );
    let (code, second) = verify_json(&echo, &payload, &with_cache);
    assert_eq!(
        (code, second["code"].as_str()),
        (0, Some("cache")),
        "{second:#}"
    );
    let (code, none) = verify_json(&echo, &payload, &["--no-code-cache"]);
    assert_eq!(
        (code, none["code"].as_str()),
        (0, Some("compiled (no cache)")),
        "{none:#}"
    );
}

#[test]
fn the_example_plugins_verify_clean() {
    let charge = json!({"order_id": 42, "amount": 1200, "currency": "eur", "customer": "cus_1"});
    /// Plugin, payload, extra arguments, the clean run's (kind, key) effects.
    type Case = (
        &'static str,
        Value,
        &'static [&'static str],
        &'static [(&'static str, &'static str)],
    );
    let cases: [Case; 6] = [
        (
            "welcome_email",
            json!({"user_id": 7, "email": "ada@example.com", "name": "Ada"}),
            &[],
            &[("email", "welcome:7"), ("kv", "welcomed:7")],
        ),
        (
            "charge_customer",
            charge,
            &["--queue", "charge-customer", "-c", "jobs.toml"],
            &[("http", "order-charge-42")],
        ),
        (
            "update_search_index",
            json!({"id": "p1", "name": "Lamp", "price": 12.5, "updated_at_ms": 1000}),
            &[],
            &[("index", "products/p1"), ("kv", "indexed:p1")],
        ),
        ("echo", json!({"hello": "world"}), &[], &[]),
        (
            "welcome_email_c",
            json!({"user_id": 7, "email": "ada@example.com", "name": "Ada"}),
            &[],
            &[("email", "welcome:7"), ("kv", "welcomed:7")],
        ),
        ("echo_c", json!({"hello": "world"}), &[], &[]),
    ];
    for (plugin, payload, extra, effects) in cases {
        let (code, report) = verify_json(&guest(plugin), &payload, extra);
        assert_eq!(code, 0, "{plugin}: {report:#}");
        assert_eq!(report["findings"], json!([]), "{plugin}");
        let runs = runs(&report);
        let expected: Vec<(String, String)> = effects
            .iter()
            .map(|(k, key)| ((*k).to_owned(), (*key).to_owned()))
            .collect();
        // Clean, then per effect a cut and a redelivery at each crash point
        // (three for email and http, two for kv and index), then fresh.
        let points: usize = effects
            .iter()
            .map(|(k, _)| if *k == "email" || *k == "http" { 3 } else { 2 })
            .sum();
        let names: Vec<&str> = runs.iter().map(|(n, _)| n.as_str()).collect();
        let mut expected_names = vec!["clean"];
        for _ in 0..points {
            expected_names.extend(["cut", "redelivery"]);
        }
        expected_names.push("fresh");
        assert_eq!(names, expected_names, "{plugin}");
        assert_eq!(runs[0].1, expected, "{plugin}: the clean run's effects");
        assert_eq!(
            runs.last().unwrap().1,
            expected,
            "{plugin}: the fresh run's effects"
        );
        // A redelivery uses the clean run's keys (it may skip a write it
        // finds done: update_search_index does not lower its kv mark).
        for (name, calls) in &runs {
            if name == "redelivery" {
                assert!(
                    calls.iter().all(|c| expected.contains(c)),
                    "{plugin}: a redelivery used other keys: {calls:?}"
                );
            }
        }
    }

    // The text report is short when clean.
    let out = khata(&["verify", guest("echo").to_str().unwrap(), "--payload", "{}"]);
    assert_eq!(out.status.code(), Some(0), "{}", text(&out.stderr));
    let stdout = text(&out.stdout);
    assert!(
        stdout.contains("clean: every run used the same keys"),
        "{stdout}"
    );
}

#[test]
fn a_handler_without_a_flaw_verifies_clean() {
    let (code, report) = verify_json(
        &guest("unstable"),
        &json!({"flaw": "none", "order_id": 42}),
        &[],
    );
    assert_eq!(code, 0, "{report:#}");
    assert_eq!(report["findings"], json!([]));
}

#[test]
fn a_key_built_from_the_clock_is_unstable_and_performs_the_effect_twice() {
    for flaw in ["clock-key", "random-key"] {
        let (code, report) = verify_json(
            &guest("unstable"),
            &json!({"flaw": flaw, "order_id": 42}),
            &[],
        );
        assert_eq!(code, 1, "{flaw}: {report:#}");
        assert_eq!(
            finding_kinds(&report),
            [
                ("key-unstable".to_owned(), json!("http")),
                ("performed-twice".to_owned(), json!("http")),
            ],
            "{flaw}: {report:#}"
        );
        let unstable = finding(&report, "key-unstable");
        let keys = unstable["keys"].as_array().unwrap();
        assert_eq!(keys.len(), 2);
        assert_ne!(keys[0], keys[1]);
        assert!(
            keys.iter()
                .all(|k| k.as_str().unwrap().starts_with("charge-"))
        );
        assert!(
            unstable["fix"]
                .as_str()
                .unwrap()
                .contains("order-charge-<order_id>")
        );
        // Twice after the provider received the request, not when the crash
        // came before it.
        let twice = finding(&report, "performed-twice")["message"]
            .as_str()
            .unwrap()
            .to_owned();
        assert!(
            twice.contains("effect #1 (http) between started and done"),
            "{twice}"
        );
        assert!(twice.contains("effect #1 (http) after done"), "{twice}");
        assert!(!twice.contains("before started"), "{twice}");
    }
}

#[test]
fn a_request_that_changes_under_one_key_is_key_reused() {
    let (code, report) = verify_json(
        &guest("unstable"),
        &json!({"flaw": "changing-body", "order_id": 42}),
        &[],
    );
    assert_eq!(code, 1, "{report:#}");
    assert_eq!(
        finding_kinds(&report),
        [
            ("key-reused".to_owned(), json!("http")),
            ("redelivery-differs".to_owned(), Value::Null),
        ],
        "{report:#}"
    );
    assert_eq!(
        finding(&report, "key-reused")["keys"],
        json!(["order-charge-42"])
    );
    let differs = finding(&report, "redelivery-differs")["message"]
        .as_str()
        .unwrap()
        .to_owned();
    assert!(differs.contains("key-reused"), "{differs}");
    // The key itself is stable.
    let runs = runs(&report);
    assert!(
        runs.iter()
            .flat_map(|(_, calls)| calls)
            .all(|(_, key)| key == "order-charge-42")
    );
}

#[test]
fn a_key_from_state_the_first_attempt_changed_performs_the_effect_twice() {
    let (code, report) = verify_json(
        &guest("unstable"),
        &json!({"flaw": "counter-key", "order_id": 42}),
        &[],
    );
    assert_eq!(code, 1, "{report:#}");
    assert_eq!(
        finding_kinds(&report),
        [("performed-twice".to_owned(), json!("http"))],
        "{report:#}"
    );
    let twice = finding(&report, "performed-twice");
    assert_eq!(twice["keys"], json!(["charge-1", "charge-2"]));
    let message = twice["message"].as_str().unwrap();
    assert!(
        message.contains("effect #2 (http) between started and done"),
        "{message}"
    );
    assert!(message.contains("effect #2 (http) after done"), "{message}");
    // Two fresh ledgers agree: the keys are stable between runs.
    let runs = runs(&report);
    let clean = &runs.first().unwrap().1;
    assert_eq!(
        clean,
        &[
            ("kv".into(), "charges".into()),
            ("http".into(), "charge-1".into())
        ]
    );
    assert_eq!(&runs.last().unwrap().1, clean);
    // The text report says what to change.
    let out = khata(&[
        "verify",
        guest("unstable").to_str().unwrap(),
        "--payload",
        r#"{"flaw": "counter-key"}"#,
    ]);
    assert_eq!(out.status.code(), Some(1));
    let stdout = text(&out.stdout);
    assert!(stdout.contains("1 finding(s):"), "{stdout}");
    assert!(stdout.contains("- performed-twice: "), "{stdout}");
    assert!(
        stdout.contains("  fix: the key must not depend on"),
        "{stdout}"
    );
}

#[test]
fn bad_input_exits_2_naming_what_is_wrong() {
    let echo = guest("echo");
    let echo = echo.to_str().unwrap();

    let out = khata(&["verify", "no/such/plugin.wasm"]);
    assert_eq!(out.status.code(), Some(2));
    let stderr = text(&out.stderr);
    assert!(
        stderr.contains("cannot read plugin no/such/plugin.wasm"),
        "{stderr}"
    );

    let out = khata(&["verify", echo, "--payload", r#"{"a": 1,"#]);
    assert_eq!(out.status.code(), Some(2));
    let stderr = text(&out.stderr);
    assert!(stderr.contains("--payload"), "{stderr}");
    assert!(stderr.contains("line 1 column 8"), "{stderr}");

    let dir = tempfile::tempdir().unwrap();
    let not_wasm = dir.path().join("notes.wasm");
    std::fs::write(&not_wasm, "not a component").unwrap();
    let out = khata(&["verify", not_wasm.to_str().unwrap()]);
    assert_eq!(out.status.code(), Some(2));
    let stderr = text(&out.stderr);
    assert!(stderr.contains("notes.wasm"), "{stderr}");
    assert!(stderr.contains("not a WebAssembly component"), "{stderr}");

    let out = khata(&["verify", echo, "--queue", "nope", "-c", "jobs.toml"]);
    assert_eq!(out.status.code(), Some(2));
    let stderr = text(&out.stderr);
    assert!(
        stderr.contains(r#"there is no queue "nope" in jobs.toml"#),
        "{stderr}"
    );

    // A queue whose grants do not cover the plugin's imports.
    let out = khata(&[
        "verify",
        guest("charge_customer").to_str().unwrap(),
        "--queue",
        "echo",
        "-c",
        "jobs.toml",
    ]);
    assert_eq!(out.status.code(), Some(2));
    let stderr = text(&out.stderr);
    assert!(stderr.contains("imports khata:plugin/http"), "{stderr}");
}

#[test]
fn khata_new_scaffolds_a_rust_handler_that_builds_and_verifies_clean() {
    let dir = tempfile::tempdir().unwrap();
    let new = |args: &[&str]| {
        Command::new(KHATA)
            .args(args)
            .current_dir(dir.path())
            .output()
            .expect("run khata new")
    };

    let out = new(&["new", "9lives", "--lang", "rust"]);
    assert_eq!(out.status.code(), Some(2));
    assert!(text(&out.stderr).contains("starts with a letter"));

    let out = new(&["new", "my-handler", "--lang", "rust"]);
    assert_eq!(out.status.code(), Some(0), "{}", text(&out.stderr));
    let project = dir.path().join("my-handler");
    for file in [
        "Cargo.toml",
        "src/lib.rs",
        "README.md",
        "khata-sdk/Cargo.toml",
        "wit/khata.wit",
    ] {
        assert!(project.join(file).is_file(), "{file} is missing");
    }
    let again = new(&["new", "my-handler"]);
    assert_eq!(again.status.code(), Some(2));
    assert!(text(&again.stderr).contains("exists already"));

    // Build it for wasm32-wasip2 in the workspace's target directory, with
    // the workspace's lock file: the dependencies are the ones already built.
    std::fs::copy(workspace().join("Cargo.lock"), project.join("Cargo.lock")).unwrap();
    let build = Command::new(std::env::var("CARGO").unwrap_or_else(|_| "cargo".into()))
        .args([
            "build",
            "--release",
            "--offline",
            "--target",
            "wasm32-wasip2",
        ])
        .env("CARGO_TARGET_DIR", workspace().join("target"))
        .current_dir(&project)
        .output()
        .expect("run cargo");
    assert!(build.status.success(), "{}", text(&build.stderr));
    let wasm = workspace().join("target/wasm32-wasip2/release/my_handler.wasm");
    let (code, report) = verify_json(
        &wasm,
        &json!({"user_id": 7, "email": "ada@example.com"}),
        &[],
    );
    assert_eq!(code, 0, "{report:#}");
    assert_eq!(
        runs(&report)[0].1,
        [
            ("email".to_owned(), "welcome-7".to_owned()),
            ("kv".to_owned(), "welcomed:7".to_owned())
        ]
    );
}

/// Runs `khata new ARGS` in `dir` with `env` set; asserts exit 2 and that
/// stderr holds `message`, and that nothing was created.
fn new_is_refused(dir: &Path, args: &[&str], env: &[(&str, &str)], message: &str) {
    let mut command = Command::new(KHATA);
    command
        .args(args)
        .current_dir(dir)
        .env_remove("KHATA_SOURCE");
    for (k, v) in env {
        command.env(k, v);
    }
    let out = command.output().expect("run khata new");
    assert_eq!(
        out.status.code(),
        Some(2),
        "{args:?}: {}",
        text(&out.stdout)
    );
    let stderr = text(&out.stderr);
    assert!(stderr.contains(message), "{args:?}: {stderr}");
    assert_eq!(
        std::fs::read_dir(dir).unwrap().count(),
        0,
        "{args:?} created something"
    );
}

/// Runs `command` in `dir`; panics with its output unless it succeeds.
fn run_ok(dir: &Path, program: &str, args: &[&str]) -> String {
    let out = Command::new(program)
        .args(args)
        .current_dir(dir)
        .output()
        .unwrap_or_else(|e| panic!("run {program}: {e}"));
    assert!(
        out.status.success(),
        "{program} {args:?}: {}\n{}",
        text(&out.stdout),
        text(&out.stderr)
    );
    format!("{}{}", text(&out.stdout), text(&out.stderr))
}

/// The scaffolded handler's clean run: one email under the user's key, then
/// the kv note.
fn assert_welcome_verifies_clean(wasm: &Path) {
    let (code, report) = verify_json(
        wasm,
        &json!({"user_id": 7, "email": "ada@example.com"}),
        &[],
    );
    assert_eq!(code, 0, "{report:#}");
    assert_eq!(report["findings"], json!([]));
    assert_eq!(
        runs(&report)[0].1,
        [
            ("email".to_owned(), "welcome-7".to_owned()),
            ("kv".to_owned(), "welcomed:7".to_owned())
        ]
    );
}

#[test]
fn khata_new_scaffolds_a_python_handler_that_builds_tests_and_verifies_clean() {
    let dir = tempfile::tempdir().unwrap();
    let refused = |args: &[&str], message: &str| new_is_refused(dir.path(), args, &[], message);
    refused(
        &["new", "my-handler", "--lang", "python"],
        "NAME \"my-handler\"",
    );
    refused(
        &["new", "9lives", "--lang", "python"],
        "starts with a letter",
    );
    refused(&["new", "class", "--lang", "python"], "Python keyword");
    refused(&["new", "json", "--lang", "python"], "would hide it");
    new_is_refused(
        dir.path(),
        &["new", "greet", "--lang", "python"],
        &[("KHATA_SOURCE", dir.path().to_str().unwrap())],
        "KHATA_SOURCE=",
    );

    // Outside a khata source tree and without KHATA_SOURCE, the SDK is the
    // one of the tree this binary was built from.
    let out = Command::new(KHATA)
        .args(["new", "greet", "--lang", "python"])
        .current_dir(dir.path())
        .env_remove("KHATA_SOURCE")
        .output()
        .expect("run khata new");
    assert_eq!(out.status.code(), Some(0), "{}", text(&out.stderr));
    let sdk = workspace().join("sdk/python");
    assert!(
        text(&out.stdout).contains(&format!("khata_sdk: by path, {}", sdk.display())),
        "{}",
        text(&out.stdout)
    );
    let project = dir.path().join("greet");
    for file in [
        "src/greet.py",
        "src/test_greet.py",
        "build.sh",
        "test.sh",
        "README.md",
    ] {
        assert!(project.join(file).is_file(), "{file} is missing");
    }
    let again = Command::new(KHATA)
        .args(["new", "greet", "--lang", "python"])
        .current_dir(dir.path())
        .output()
        .unwrap();
    assert_eq!(again.status.code(), Some(2));
    assert!(text(&again.stderr).contains("exists already"));

    let tests = run_ok(&project, "./test.sh", &[]);
    assert!(
        tests.contains("Ran 3 tests") && tests.contains("OK"),
        "{tests}"
    );
    let built = run_ok(&project, "./build.sh", &[]);
    assert!(built.contains("importing khata kv, email, log"), "{built}");
    assert_welcome_verifies_clean(&project.join("greet.wasm"));
}

#[test]
fn khata_new_scaffolds_a_js_handler_that_builds_tests_and_verifies_clean() {
    let dir = tempfile::tempdir().unwrap();
    let source = workspace();
    let source = source.to_str().unwrap();
    let refused = |args: &[&str], message: &str| {
        new_is_refused(dir.path(), args, &[("KHATA_SOURCE", source)], message)
    };
    refused(&["new", "Greet", "--lang", "js"], "NAME \"Greet\"");
    refused(
        &["new", "node_modules", "--lang", "js"],
        "npm package's name",
    );
    refused(&["new", "greet.js", "--lang", "js"], "NAME \"greet.js\"");

    let out = Command::new(KHATA)
        .args(["new", "greet-js", "--lang", "js"])
        .current_dir(dir.path())
        .env("KHATA_SOURCE", source)
        .output()
        .expect("run khata new");
    assert_eq!(out.status.code(), Some(0), "{}", text(&out.stderr));
    let project = dir.path().join("greet-js");
    for file in [
        "package.json",
        "src/handler.js",
        "src/welcome.js",
        "test/welcome.test.js",
        "README.md",
    ] {
        assert!(project.join(file).is_file(), "{file} is missing");
    }

    let tests = run_ok(&project, "npm", &["test"]);
    assert!(
        tests.contains("# pass 2") && tests.contains("# fail 0"),
        "{tests}"
    );
    let built = run_ok(&project, "npm", &["run", "build"]);
    assert!(built.contains("importing khata kv, email, log"), "{built}");
    assert_welcome_verifies_clean(&project.join("greet-js.wasm"));
}
