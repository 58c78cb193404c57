//! `khata new NAME --lang rust`: a handler project that builds as it is.
//!
//! The project is its own Cargo workspace (so that it builds wherever it is
//! created, inside another workspace too) with `src/lib.rs` (a commented
//! example handler and its unit tests), a README (build, test, verify,
//! deploy) and `.gitignore`.
//!
//! Where `khata-sdk` comes from: created inside a khata source tree (a
//! parent directory holds `sdk/Cargo.toml` of `khata-sdk` and
//! `wit/khata.wit`), the project depends on that `sdk/` by path. Anywhere
//! else it gets a copy of the SDK this binary was built with, in
//! `khata-sdk/` and `wit/` next to `src/`: it builds offline, with no
//! registry or git access for khata itself, and its WIT matches this daemon.

use std::fmt::Write as _;
use std::path::{Path, PathBuf};

/// Handler languages `khata new` knows.
#[derive(Debug, Clone, Copy, PartialEq, Eq, clap::ValueEnum)]
pub enum Lang {
    Rust,
    Python,
    Js,
}

/// Why nothing (or not everything) was created.
#[derive(Debug, thiserror::Error)]
pub enum ScaffoldError {
    /// A bad name, an unavailable language, an existing directory (exit 2).
    #[error("{0}")]
    Usage(String),
    /// Writing failed (exit 1).
    #[error("{0}")]
    Failed(String),
}

/// What [`create`] made.
#[derive(Debug)]
pub struct Created {
    pub dir: PathBuf,
    /// `Some(path)` when the SDK is the khata source tree's `sdk/`.
    pub sdk_path: Option<PathBuf>,
    pub wasm_name: String,
}

impl Created {
    pub fn render(&self) -> String {
        let mut s = String::new();
        let _ = writeln!(s, "created {}", self.dir.display());
        match &self.sdk_path {
            Some(p) => {
                let _ = writeln!(s, "khata-sdk: by path, {}", p.display());
            }
            None => {
                let _ = writeln!(
                    s,
                    "khata-sdk: a copy in {}",
                    self.dir.join("khata-sdk").display()
                );
            }
        }
        let _ = writeln!(
            s,
            "next: cd {} && cargo build --release --target wasm32-wasip2 \
             && khata verify target/wasm32-wasip2/release/{}.wasm --payload '{}'",
            self.dir.display(),
            self.wasm_name,
            EXAMPLE_PAYLOAD
        );
        s
    }
}

/// The payload the example handler takes.
pub const EXAMPLE_PAYLOAD: &str = r#"{"user_id": 7, "email": "ada@example.com"}"#;

/// The SDK's sources, vendored into projects made outside a khata source tree.
const SDK_FILES: [(&str, &str); 9] = [
    ("lib.rs", include_str!("../../sdk/src/lib.rs")),
    ("email.rs", include_str!("../../sdk/src/email.rs")),
    ("error.rs", include_str!("../../sdk/src/error.rs")),
    ("handler.rs", include_str!("../../sdk/src/handler.rs")),
    ("http.rs", include_str!("../../sdk/src/http.rs")),
    ("index.rs", include_str!("../../sdk/src/index.rs")),
    ("job.rs", include_str!("../../sdk/src/job.rs")),
    ("kv.rs", include_str!("../../sdk/src/kv.rs")),
    ("log.rs", include_str!("../../sdk/src/log.rs")),
];
const WIT: &str = include_str!("../../wit/khata.wit");

/// Creates the project `NAME` in `parent`.
pub fn create(parent: &Path, name: &str, lang: Lang) -> Result<Created, ScaffoldError> {
    match lang {
        Lang::Rust => {}
        Lang::Python | Lang::Js => {
            let lang = if lang == Lang::Python { "python" } else { "js" };
            return Err(ScaffoldError::Usage(format!(
                "--lang {lang}: handlers in this language are not yet available from `khata new`; \
                 use --lang rust"
            )));
        }
    }
    check_name(name)?;
    let parent = std::path::absolute(parent)
        .map_err(|e| ScaffoldError::Failed(format!("cannot resolve {}: {e}", parent.display())))?;
    let dir = parent.join(name);
    if dir.exists() {
        return Err(ScaffoldError::Usage(format!(
            "{} exists already; choose another NAME or remove it",
            dir.display()
        )));
    }
    let sdk_path = khata_source_tree(&parent).map(|root| root.join("sdk"));
    let crate_name = name.replace('-', "_");
    let dependency = match &sdk_path {
        Some(p) => format!("{{ path = {:?} }}", p.display().to_string()),
        None => "{ path = \"khata-sdk\" }".to_owned(),
    };
    let mut files: Vec<(PathBuf, String)> = vec![
        (PathBuf::from("Cargo.toml"), cargo_toml(name, &dependency)),
        (PathBuf::from("src/lib.rs"), lib_rs(name)),
        (PathBuf::from("README.md"), readme(name, &crate_name)),
        (PathBuf::from(".gitignore"), "/target\n".to_owned()),
    ];
    if sdk_path.is_none() {
        files.push((
            PathBuf::from("khata-sdk/Cargo.toml"),
            SDK_CARGO_TOML.to_owned(),
        ));
        for (file, text) in SDK_FILES {
            files.push((Path::new("khata-sdk/src").join(file), text.to_owned()));
        }
        files.push((PathBuf::from("wit/khata.wit"), WIT.to_owned()));
    }
    for (path, text) in &files {
        let path = dir.join(path);
        if let Some(d) = path.parent() {
            std::fs::create_dir_all(d).map_err(|e| {
                ScaffoldError::Failed(format!("cannot create {}: {e}", d.display()))
            })?;
        }
        std::fs::write(&path, text)
            .map_err(|e| ScaffoldError::Failed(format!("cannot write {}: {e}", path.display())))?;
    }
    Ok(Created {
        dir,
        sdk_path,
        wasm_name: crate_name,
    })
}

fn check_name(name: &str) -> Result<(), ScaffoldError> {
    let ok = name.chars().next().is_some_and(|c| c.is_ascii_alphabetic())
        && name
            .chars()
            .all(|c| c.is_ascii_alphanumeric() || c == '_' || c == '-')
        && name.len() <= 64;
    if ok {
        Ok(())
    } else {
        Err(ScaffoldError::Usage(format!(
            "NAME {name:?}: a handler's name starts with a letter and holds only ASCII \
             letters, digits, '_' and '-' (at most 64)"
        )))
    }
}

/// The nearest ancestor of `dir` that is a khata source tree.
fn khata_source_tree(dir: &Path) -> Option<PathBuf> {
    dir.ancestors()
        .find(|d| {
            d.join("wit/khata.wit").is_file()
                && std::fs::read_to_string(d.join("sdk/Cargo.toml"))
                    .is_ok_and(|t| t.contains("name = \"khata-sdk\""))
        })
        .map(Path::to_path_buf)
}

fn cargo_toml(name: &str, dependency: &str) -> String {
    format!(
        r#"[package]
name = "{name}"
version = "0.1.0"
edition = "2024"
publish = false

# A khata handler is a WebAssembly component: build it with
#   cargo build --release --target wasm32-wasip2
[lib]
crate-type = ["cdylib"]

[dependencies]
khata-sdk = {dependency}
serde = {{ version = "1", features = ["derive"] }}
serde_json = "1"

# This project is a workspace of its own, wherever it lives.
[workspace]
"#
    )
}

const SDK_CARGO_TOML: &str = r#"[package]
name = "khata-sdk"
description = "Write khata job handlers in Rust: typed payloads and effects that happen once"
version = "0.1.0"
edition = "2024"
license = "Apache-2.0"
publish = false

# A copy of the SDK made by `khata new`; its WIT is ../wit/khata.wit.
[lib]
doctest = false

[dependencies]
serde = { version = "1", features = ["derive"] }
serde_json = "1"
wit-bindgen = "0.63"
"#;

fn lib_rs(name: &str) -> String {
    format!(
        r##"//! `{name}`: a khata handler.
//!
//! Payload: `{{"user_id": 7, "email": "ada@example.com"}}`.
//! Result: `{{"user_id": 7, "message_id": "<...>"}}`.
//! Grants its queue needs in jobs.toml: `grants = {{ kv = true, email = true }}`.
//!
//! A job is delivered at least once: after a crash, a timeout or a retry,
//! every line below may run again. The daemon makes the *effects* happen
//! once, provided that each effect's key names that one effect and that the
//! same job always builds the same request under it. `khata verify` checks
//! exactly that (see the README).

use khata_sdk::prelude::*;
use serde::Deserialize;
use serde_json::{{Value, json}};

/// The payload.
#[derive(Deserialize)]
struct Welcome {{
    user_id: u64,
    email: String,
}}

fn handle(job: Job) -> Result<Value, Error> {{
    let welcome: Welcome = job.payload()?;

    // An external effect takes an idempotency key. This one is a business
    // key built from the payload: one welcome per user, however often this
    // job (or another job for the same user) runs. Never build a key from
    // the clock, randomness or `job.attempt()`: a redelivery would then
    // send a second message.
    let receipt = email::send(welcome_key(welcome.user_id), &message(&welcome))?;

    // An embedded write: writing the same value again is harmless.
    kv::put(format!("welcomed:{{}}", welcome.user_id), &receipt.message_id)?;

    Ok(json!({{ "user_id": welcome.user_id, "message_id": receipt.message_id }}))
}}

/// The key of the welcome message of one user.
fn welcome_key(user_id: u64) -> String {{
    format!("welcome-{{user_id}}")
}}

/// The message: built from the payload alone, so that every run builds the
/// same request under the same key.
fn message(welcome: &Welcome) -> email::Message {{
    email::Message::new("Welcome!", "Hello,\n\nyour account is ready.\n").to(welcome.email.clone())
}}

khata_sdk::handler!(handle);

// The handler's logic, tested natively with `cargo test` (the effects need
// the daemon: `khata verify` runs the whole handler).
#[cfg(test)]
mod tests {{
    use super::*;

    #[test]
    fn the_key_names_the_user_not_the_attempt() {{
        assert_eq!(welcome_key(7), "welcome-7");
    }}

    #[test]
    fn the_message_is_built_from_the_payload_alone() {{
        let job = Job::new("j1", "welcome", r#"{{"user_id": 7, "email": "ada@example.com"}}"#);
        let welcome: Welcome = job.payload().unwrap();
        let (a, b) = (message(&welcome), message(&welcome));
        assert_eq!(a.to, ["ada@example.com"]);
        assert_eq!((a.subject, a.text), (b.subject, b.text));
    }}
}}
"##
    )
}

fn readme(name: &str, crate_name: &str) -> String {
    format!(
        r#"# {name}

A khata job handler, made by `khata new {name} --lang rust`.
`src/lib.rs` is a commented example: it mails a welcome message once per
user and notes it in kv. Change it to do your job.

## Build

```sh
rustup target add wasm32-wasip2
cargo build --release --target wasm32-wasip2
```

The component is `target/wasm32-wasip2/release/{crate_name}.wasm`.

## Test

```sh
cargo test
```

runs the unit tests of the handler's logic natively. The effects (kv,
index, email, http) exist only inside the daemon; to run the whole handler,
verify it.

## Verify

```sh
khata verify target/wasm32-wasip2/release/{crate_name}.wasm \
  --payload '{payload}'
```

runs the handler against a throwaway ledger with recorded providers
(nothing is sent), then again after a crash at every effect boundary, and
once more from the start. It exits 0 when the handler is safe to run twice,
and 1 with what to change otherwise: keys built from time or randomness,
requests that change under one key, effects performed twice. Add
`--queue QUEUE -c jobs.toml` to run with that queue's grants and limits.

## Deploy

Copy the component into the daemon's `plugins_dir` under the plugin name a
queue uses, and give that queue the grants the handler needs:

```sh
cp target/wasm32-wasip2/release/{crate_name}.wasm /path/to/plugins_dir/{crate_name}.wasm
```

```toml
[queues.{name}]
plugin = "{crate_name}"
grants = {{ kv = true, email = true }}
```

The daemon loads the new file by itself (it watches `plugins_dir`). Then:

```sh
khata enqueue {name} '{payload}'
```
"#,
        payload = EXAMPLE_PAYLOAD
    )
}
