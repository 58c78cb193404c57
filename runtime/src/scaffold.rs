//! `khata new NAME --lang rust|python|js`: a handler project that builds as
//! it is, with an example handler that does one fenced effect under a
//! business key, its unit tests and a README (build, test, verify, deploy).
//!
//! Rust: the project is its own Cargo workspace (so that it builds wherever it is
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
//!
//! Python and JavaScript: the project uses the SDK of a khata source tree by
//! path (`sdk/python`, `sdk/js`), written into its build and test scripts.
//! The tree is the nearest one above the project, else `$KHATA_SOURCE`,
//! else the tree this binary was built from while it still exists; without
//! one, nothing is created.

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
    /// Where the SDK comes from, for the user.
    pub sdk: String,
    /// The commands that build and verify the project, run in `dir`.
    pub next: String,
}

impl Created {
    pub fn render(&self) -> String {
        let mut s = String::new();
        let _ = writeln!(s, "created {}", self.dir.display());
        let _ = writeln!(s, "{}", self.sdk);
        let _ = writeln!(s, "next: cd {} && {}", self.dir.display(), self.next);
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

/// Creates the project `NAME` in `parent`. Nothing is created when the name
/// does not suit the language, the directory exists, or (Python, JS) no
/// khata source tree holds the SDK.
pub fn create(parent: &Path, name: &str, lang: Lang) -> Result<Created, ScaffoldError> {
    match lang {
        Lang::Rust => check_name(name)?,
        Lang::Python => check_python_name(name)?,
        Lang::Js => check_js_name(name)?,
    }
    let parent = std::path::absolute(parent)
        .map_err(|e| ScaffoldError::Failed(format!("cannot resolve {}: {e}", parent.display())))?;
    let dir = parent.join(name);
    if dir.exists() {
        return Err(ScaffoldError::Usage(format!(
            "{} exists already; choose another NAME or remove it",
            dir.display()
        )));
    }
    let (files, sdk, next) = match lang {
        Lang::Rust => rust_project(&parent, name),
        Lang::Python => python_project(&parent, name)?,
        Lang::Js => js_project(&parent, name)?,
    };
    for (path, text) in &files {
        let path = dir.join(path);
        if let Some(d) = path.parent() {
            std::fs::create_dir_all(d).map_err(|e| {
                ScaffoldError::Failed(format!("cannot create {}: {e}", d.display()))
            })?;
        }
        std::fs::write(&path, text)
            .map_err(|e| ScaffoldError::Failed(format!("cannot write {}: {e}", path.display())))?;
        if path.extension().is_some_and(|e| e == "sh") {
            make_executable(&path)?;
        }
    }
    Ok(Created { dir, sdk, next })
}

/// A project's files (relative path, text), where its SDK comes from, and
/// the commands that build and verify it.
type Project = (Vec<(PathBuf, String)>, String, String);

fn rust_project(parent: &Path, name: &str) -> Project {
    let sdk_path = khata_source_tree(parent).map(|root| root.join("sdk"));
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
    let sdk = match &sdk_path {
        Some(p) => format!("khata-sdk: by path, {}", p.display()),
        None => {
            files.push((
                PathBuf::from("khata-sdk/Cargo.toml"),
                SDK_CARGO_TOML.to_owned(),
            ));
            for (file, text) in SDK_FILES {
                files.push((Path::new("khata-sdk/src").join(file), text.to_owned()));
            }
            files.push((PathBuf::from("wit/khata.wit"), WIT.to_owned()));
            "khata-sdk: a copy in khata-sdk/".to_owned()
        }
    };
    let next = format!(
        "cargo build --release --target wasm32-wasip2 \
         && khata verify target/wasm32-wasip2/release/{crate_name}.wasm --payload '{EXAMPLE_PAYLOAD}'"
    );
    (files, sdk, next)
}

fn python_project(parent: &Path, name: &str) -> Result<Project, ScaffoldError> {
    let root = sdk_source_tree(parent, "python", "sdk/python/khata_sdk/__init__.py")?;
    let sdk = root.join("sdk/python");
    let files = vec![
        (
            PathBuf::from(format!("src/{name}.py")),
            python_handler(name),
        ),
        (
            PathBuf::from(format!("src/test_{name}.py")),
            python_test(name),
        ),
        (PathBuf::from("build.sh"), python_build_sh(name, &sdk)),
        (PathBuf::from("test.sh"), python_test_sh(&sdk)),
        (PathBuf::from("README.md"), python_readme(name, &sdk)),
        (
            PathBuf::from(".gitignore"),
            format!("/{name}.wasm\n__pycache__/\n"),
        ),
    ];
    let next = format!("./build.sh && khata verify {name}.wasm --payload '{EXAMPLE_PAYLOAD}'");
    Ok((
        files,
        format!("khata_sdk: by path, {}", sdk.display()),
        next,
    ))
}

fn js_project(parent: &Path, name: &str) -> Result<Project, ScaffoldError> {
    let root = sdk_source_tree(parent, "js", "sdk/js/bin/khata-build.js")?;
    let sdk = root.join("sdk/js");
    let files = vec![
        (PathBuf::from("package.json"), js_package_json(name, &sdk)),
        (PathBuf::from("src/handler.js"), js_handler(name)),
        (PathBuf::from("src/welcome.js"), JS_WELCOME.to_owned()),
        (PathBuf::from("test/welcome.test.js"), JS_TEST.to_owned()),
        (PathBuf::from("README.md"), js_readme(name, &sdk)),
        (
            PathBuf::from(".gitignore"),
            format!("/{name}.wasm\nnode_modules/\n"),
        ),
    ];
    let next = format!("npm run build && khata verify {name}.wasm --payload '{EXAMPLE_PAYLOAD}'");
    Ok((
        files,
        format!("khata-sdk: by path, {}", sdk.display()),
        next,
    ))
}

#[cfg(unix)]
fn make_executable(path: &Path) -> Result<(), ScaffoldError> {
    use std::os::unix::fs::PermissionsExt as _;
    std::fs::set_permissions(path, std::fs::Permissions::from_mode(0o755)).map_err(|e| {
        ScaffoldError::Failed(format!("cannot make {} executable: {e}", path.display()))
    })
}

#[cfg(not(unix))]
fn make_executable(_: &Path) -> Result<(), ScaffoldError> {
    Ok(())
}

/// The khata source tree whose SDK a Python or JS project uses by path: the
/// nearest above `parent`, else `$KHATA_SOURCE`, else the tree this binary
/// was built from. `marker` is a file that tree's SDK must hold.
fn sdk_source_tree(parent: &Path, lang: &str, marker: &str) -> Result<PathBuf, ScaffoldError> {
    let built_from = Path::new(env!("CARGO_MANIFEST_DIR")).parent();
    let from_env = std::env::var_os("KHATA_SOURCE").map(PathBuf::from);
    if let Some(dir) = &from_env
        && (khata_source_tree(dir).as_deref() != Some(dir.as_path()) || !dir.join(marker).is_file())
    {
        return Err(ScaffoldError::Usage(format!(
            "KHATA_SOURCE={}: not a khata source tree with {marker}",
            dir.display()
        )));
    }
    let found = khata_source_tree(parent)
        .filter(|root| root.join(marker).is_file())
        .or(from_env)
        .or_else(|| {
            built_from
                .filter(|root| khata_source_tree(root).as_deref() == Some(*root))
                .filter(|root| root.join(marker).is_file())
                .map(Path::to_path_buf)
        });
    found.ok_or_else(|| {
        ScaffoldError::Usage(format!(
            "--lang {lang}: the project uses the {lang} SDK of a khata source tree by path, and \
             there is none above {} nor at {}; create the project inside a khata checkout, or \
             set KHATA_SOURCE to one",
            parent.display(),
            built_from.map_or_else(|| "?".into(), |p| p.display().to_string()),
        ))
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

/// Python keywords: not a module name.
const PYTHON_KEYWORDS: &str = "False None True and as assert async await break class continue \
    def del elif else except finally for from global if import in is lambda nonlocal not or \
    pass raise return try while with yield";

/// Modules a handler's module must not shadow: the SDK's and the build's own,
/// and the standard library's (Python 3.11's `sys.stdlib_module_names`,
/// public ones).
const PYTHON_TAKEN: &str = "khata_sdk khata_build_entry wit_world componentize_py_types \
    componentize_py_runtime componentize_py_async_support \
    abc aifc antigravity argparse array ast asynchat asyncio asyncore atexit audioop base64 \
    bdb binascii bisect builtins bz2 cProfile calendar cgi cgitb chunk cmath cmd code codecs \
    codeop collections colorsys compileall concurrent configparser contextlib contextvars copy \
    copyreg crypt csv ctypes curses dataclasses datetime dbm decimal difflib dis distutils \
    doctest email encodings ensurepip enum errno faulthandler fcntl filecmp fileinput fnmatch \
    fractions ftplib functools gc genericpath getopt getpass gettext glob graphlib grp gzip \
    hashlib heapq hmac html http idlelib imaplib imghdr imp importlib inspect io ipaddress \
    itertools json keyword lib2to3 linecache locale logging lzma mailbox mailcap marshal math \
    mimetypes mmap modulefinder msilib msvcrt multiprocessing netrc nis nntplib nt ntpath \
    nturl2path numbers opcode operator optparse os ossaudiodev pathlib pdb pickle pickletools \
    pipes pkgutil platform plistlib poplib posix posixpath pprint profile pstats pty pwd \
    py_compile pyclbr pydoc pydoc_data pyexpat queue quopri random re readline reprlib \
    resource rlcompleter runpy sched secrets select selectors shelve shlex shutil signal site \
    smtpd smtplib sndhdr socket socketserver spwd sqlite3 sre_compile sre_constants sre_parse \
    ssl stat statistics string stringprep struct subprocess sunau symtable sys sysconfig \
    syslog tabnanny tarfile telnetlib tempfile termios textwrap this threading time timeit \
    tkinter token tokenize tomllib trace traceback tracemalloc tty turtle turtledemo types \
    typing unicodedata unittest urllib uu uuid venv warnings wave weakref webbrowser winreg \
    winsound wsgiref xdrlib xml xmlrpc zipapp zipfile zipimport zlib zoneinfo";

/// A Python handler's name is its module's name (and the plugin's): an
/// identifier of ASCII letters, digits and `_` that starts with a letter.
fn check_python_name(name: &str) -> Result<(), ScaffoldError> {
    let identifier = name.chars().next().is_some_and(|c| c.is_ascii_alphabetic())
        && name.chars().all(|c| c.is_ascii_alphanumeric() || c == '_')
        && name.len() <= 64;
    if !identifier {
        return Err(ScaffoldError::Usage(format!(
            "NAME {name:?}: a Python handler's name is its module's name: it starts with a \
             letter and holds only ASCII letters, digits and '_' (at most 64)"
        )));
    }
    if PYTHON_KEYWORDS.split_whitespace().any(|k| k == name) {
        return Err(ScaffoldError::Usage(format!(
            "NAME {name:?}: a Python keyword cannot name a module; choose another NAME"
        )));
    }
    if PYTHON_TAKEN.split_whitespace().any(|k| k == name) {
        return Err(ScaffoldError::Usage(format!(
            "NAME {name:?}: a module of that name exists already (the standard library's or \
             the SDK's), and the handler's module would hide it; choose another NAME"
        )));
    }
    Ok(())
}

/// A JavaScript handler's name is its npm package's name (and the
/// plugin's): lower-case ASCII letters, digits, `_` and `-`, starting with a
/// letter.
fn check_js_name(name: &str) -> Result<(), ScaffoldError> {
    let ok = name.chars().next().is_some_and(|c| c.is_ascii_lowercase())
        && name
            .chars()
            .all(|c| c.is_ascii_lowercase() || c.is_ascii_digit() || c == '_' || c == '-')
        && name.len() <= 64
        && name != "node_modules";
    if ok {
        Ok(())
    } else {
        Err(ScaffoldError::Usage(format!(
            "NAME {name:?}: a JavaScript handler's name is its npm package's name: it starts \
             with a lower-case letter and holds only lower-case ASCII letters, digits, '_' and \
             '-' (at most 64; not node_modules)"
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
    let head = format!(
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

"#
    );
    let wasm = format!("target/wasm32-wasip2/release/{crate_name}.wasm");
    head + &verify_deploy(&wasm, crate_name, name)
}

/// The end of every project's README ([`README_VERIFY_DEPLOY`]) for the
/// component at `wasm`, deployed as plugin `plugin` of queue `queue`.
fn verify_deploy(wasm: &str, plugin: &str, queue: &str) -> String {
    README_VERIFY_DEPLOY
        .replace("@WASM@", wasm)
        .replace("@PLUGIN@", plugin)
        .replace("@QUEUE@", queue)
        .replace("@PAYLOAD@", EXAMPLE_PAYLOAD)
}

/// `text` quoted for a POSIX shell.
fn sh_quote(text: &str) -> String {
    format!("'{}'", text.replace('\'', r"'\''"))
}

/// Fills a template: `@NAME@`, `@SDK@` (the SDK's directory), `@PAYLOAD@`.
fn fill(template: &str, name: &str, sdk: &Path) -> String {
    template
        .replace("@NAME@", name)
        .replace("@SDK@", &sdk.display().to_string())
        .replace("@PAYLOAD@", EXAMPLE_PAYLOAD)
}

fn python_handler(name: &str) -> String {
    fill(PYTHON_HANDLER, name, Path::new(""))
}

fn python_test(name: &str) -> String {
    fill(PYTHON_TEST, name, Path::new(""))
}

fn python_build_sh(name: &str, sdk: &Path) -> String {
    format!(
        r#"#!/bin/sh
# Builds src/{name}.py into the component {name}.wasm, with the khata
# Python SDK of the khata source tree (by path). Extra arguments go to the
# build (-v shows componentize-py's output).
set -eu
cd "$(dirname "$0")"
PYTHONPATH={sdk} exec python3 -m khata_sdk.build src/{name}.py -o {name}.wasm "$@"
"#,
        sdk = sh_quote(&sdk.display().to_string())
    )
}

fn python_test_sh(sdk: &Path) -> String {
    format!(
        r#"#!/bin/sh
# Runs the unit tests of the handler's logic (src/test_*.py) with plain
# Python: the effects need the daemon, `khata verify` runs the whole handler.
set -eu
cd "$(dirname "$0")"
PYTHONPATH={sdk} exec python3 -m unittest discover -s src -t src "$@"
"#,
        sdk = sh_quote(&sdk.display().to_string())
    )
}

fn python_readme(name: &str, sdk: &Path) -> String {
    fill(PYTHON_README, name, sdk) + &verify_deploy(&format!("{name}.wasm"), name, name)
}

fn js_package_json(name: &str, sdk: &Path) -> String {
    let build = format!(
        "node {} src/handler.js -o {name}.wasm",
        sh_quote(&sdk.join("bin/khata-build.js").display().to_string())
    );
    let package = serde_json::json!({
        "name": name,
        "version": "0.1.0",
        "private": true,
        "type": "module",
        "description": "A khata job handler",
        "scripts": {
            "build": build,
            "test": "node --test test/",
        },
    });
    let mut text = serde_json::to_string_pretty(&package).expect("JSON of a literal");
    text.push('\n');
    text
}

fn js_handler(name: &str) -> String {
    fill(JS_HANDLER, name, Path::new(""))
}

fn js_readme(name: &str, sdk: &Path) -> String {
    fill(JS_README, name, sdk) + &verify_deploy(&format!("{name}.wasm"), name, name)
}

const PYTHON_HANDLER: &str = r#""""`@NAME@`: a khata handler.

Payload: ``{"user_id": 7, "email": "ada@example.com"}``.
Result: ``{"user_id": 7, "message_id": "<...>"}``.
Grants its queue needs in jobs.toml: ``grants = { kv = true, email = true }``.

A job is delivered at least once: after a crash, a timeout or a retry,
every line below may run again. The daemon makes the *effects* happen
once, provided that each effect's key names that one effect and that the
same job always builds the same request under it. ``khata verify`` checks
exactly that (see the README).
"""

from dataclasses import dataclass

from khata_sdk import Job, email, handler, kv


@dataclass
class Welcome:
    """The payload."""

    user_id: int
    email: str


@handler
def handle(job: Job):
    welcome = job.payload(Welcome)

    # An external effect takes an idempotency key. This one is a business
    # key built from the payload: one welcome per user, however often this
    # job (or another job for the same user) runs. Never build a key from
    # the clock, randomness or `job.attempt`: a redelivery would then send
    # a second message.
    receipt = email.send(welcome_key(welcome.user_id), message(welcome))

    # An embedded write: writing the same value again is harmless.
    kv.put(f"welcomed:{welcome.user_id}", receipt.message_id)

    return {"user_id": welcome.user_id, "message_id": receipt.message_id}


def welcome_key(user_id: int) -> str:
    """The key of the welcome message of one user."""
    return f"welcome-{user_id}"


def message(welcome: Welcome) -> email.Message:
    """The message: built from the payload alone, so that every run builds
    the same request under the same key."""
    return email.Message("Welcome!", "Hello,\n\nyour account is ready.\n").to(welcome.email)
"#;

const PYTHON_TEST: &str = r#""""Unit tests of the handler's logic with plain Python (`./test.sh`); the
effects need the daemon: `khata verify` runs the whole handler."""

import unittest

from khata_sdk import Fail, Job

from @NAME@ import Welcome, message, welcome_key


class HandlerTest(unittest.TestCase):
    def test_the_key_names_the_user_not_the_attempt(self):
        self.assertEqual(welcome_key(7), "welcome-7")

    def test_the_message_is_built_from_the_payload_alone(self):
        job = Job("j1", "welcome", '{"user_id": 7, "email": "ada@example.com"}')
        welcome = job.payload(Welcome)
        a, b = message(welcome), message(welcome)
        self.assertEqual(a.to_addresses, ["ada@example.com"])
        self.assertEqual((a.subject, a.text), (b.subject, b.text))

    def test_a_payload_without_email_fails(self):
        with self.assertRaises(Fail) as caught:
            Job("j1", "welcome", '{"user_id": 7}').payload(Welcome)
        self.assertEqual(caught.exception.message, "bad payload: missing field `email`")


if __name__ == "__main__":
    unittest.main()
"#;

const PYTHON_README: &str = r#"# @NAME@

A khata job handler in Python, made by `khata new @NAME@ --lang python`.
`src/@NAME@.py` is a commented example: it mails a welcome message once per
user and notes it in kv. Change it to do your job.

The khata Python SDK (`khata_sdk`) is used by path from the khata source
tree, `@SDK@`: `build.sh` and `test.sh` put it on `PYTHONPATH`. (It is not
published to a package index yet; if the tree moves, change the path in
both scripts.)

## Build

Python 3.11 or newer, and componentize-py at the version the SDK pins:

```sh
python3 -m pip install -e @SDK@    # khata_sdk and componentize-py
./build.sh
```

The component is `@NAME@.wasm` (it carries a Python interpreter: about
18 MB). It imports only the khata interfaces that the handler's modules
import from `khata_sdk` (here `email` and `kv`), plus `log`. Modules next
to `src/@NAME@.py` may be imported: the whole `src/` is in the component.

## Test

```sh
./test.sh
```

runs the unit tests in `src/test_@NAME@.py` with plain Python. The effects
(kv, index, email, http) exist only inside the daemon, where calling them
outside it raises `NoHost`; to run the whole handler, verify it.

"#;

const JS_HANDLER: &str = r#"// `@NAME@`: a khata handler.
//
// Payload: {"user_id": 7, "email": "ada@example.com"}.
// Result: {"user_id": 7, "message_id": "<...>"}.
// Grants its queue needs in jobs.toml: grants = { kv = true, email = true }.
//
// A job is delivered at least once: after a crash, a timeout or a retry,
// every line below may run again. The daemon makes the *effects* happen
// once, provided that each effect's key names that one effect and that the
// same job always builds the same request under it. `khata verify` checks
// exactly that (see the README).
import { email, field, handler, kv } from 'khata-sdk';

import { welcomeKey, welcomeMessage } from './welcome.js';

export const handle = handler((job) => {
  const welcome = job.payload((p) => ({
    userId: field(p, 'user_id', 'integer'),
    email: field(p, 'email', 'string'),
  }));

  // An external effect takes an idempotency key. This one is a business
  // key built from the payload: one welcome per user, however often this
  // job (or another job for the same user) runs. Never build a key from
  // the clock, randomness or `job.attempt`: a redelivery would then send a
  // second message.
  const m = welcomeMessage(welcome);
  const receipt = email.send(welcomeKey(welcome.userId), new email.Message(m.subject, m.text).to(m.to));

  // An embedded write: writing the same value again is harmless.
  kv.put(`welcomed:${welcome.userId}`, receipt.messageId);

  return { user_id: welcome.userId, message_id: receipt.messageId };
});
"#;

const JS_WELCOME: &str = r#"// The handler's logic, apart from the effects so that `npm test` runs it
// with plain Node (the effects exist only inside the daemon).

/** The key of the welcome message of one user. */
export function welcomeKey(userId) {
  return `welcome-${userId}`;
}

/** The message: built from the payload alone, so that every run builds the
 * same request under the same key. */
export function welcomeMessage(welcome) {
  return { subject: 'Welcome!', text: 'Hello,\n\nyour account is ready.\n', to: welcome.email };
}
"#;

const JS_TEST: &str = r#"// Unit tests of the handler's logic with Node's test runner (`npm test`);
// `khata verify` runs the whole handler.
import assert from 'node:assert/strict';
import { test } from 'node:test';

import { welcomeKey, welcomeMessage } from '../src/welcome.js';

test('the key names the user, not the attempt', () => {
  assert.equal(welcomeKey(7), 'welcome-7');
});

test('the message is built from the payload alone', () => {
  const welcome = { userId: 7, email: 'ada@example.com' };
  const a = welcomeMessage(welcome);
  assert.equal(a.to, 'ada@example.com');
  assert.deepEqual(a, welcomeMessage(welcome));
});
"#;

const JS_README: &str = r#"# @NAME@

A khata job handler in JavaScript, made by `khata new @NAME@ --lang js`.
`src/handler.js` is a commented example: it mails a welcome message once
per user and notes it in kv; its logic is in `src/welcome.js`. Change them
to do your job.

The khata JavaScript SDK (`khata-sdk`) is used by path from the khata
source tree, `@SDK@`: `npm run build` runs its build tool, which bundles
the handler with `khata-sdk` resolved to that directory. (It is not
published to npm yet; if the tree moves, change the path in
`package.json`.)

## Build

Node.js 20 or newer. Once, install the SDK's build tools (componentize-js,
jco, rolldown, at the versions of its `package-lock.json`):

```sh
(cd @SDK@ && npm ci)
npm run build
```

The component is `@NAME@.wasm` (it carries a JavaScript engine: about
12 MB). It imports only the khata interfaces the bundled handler uses (here
`email` and `kv`), plus `log`. Inside a handler there is no clock,
randomness, console or network: log with `log.info(...)`.

## Test

```sh
npm test
```

runs `test/*.test.js` with Node's test runner on the logic in
`src/welcome.js`. The effects (kv, index, email, http) exist only inside
the daemon, so keep what you unit-test in modules that do not import
`khata-sdk`; to run the whole handler, verify it.

"#;

/// The end of every project's README: verify, deploy (`@WASM@` the
/// component, `@PLUGIN@` its plugin name, `@QUEUE@` the queue's).
const README_VERIFY_DEPLOY: &str = r#"## Verify

```sh
khata verify @WASM@ --payload '@PAYLOAD@'
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
cp @WASM@ /path/to/plugins_dir/@PLUGIN@.wasm
```

```toml
[queues.@QUEUE@]
plugin = "@PLUGIN@"
grants = { kv = true, email = true }
```

The daemon loads the new file by itself (it watches `plugins_dir`) and
compiles it once (the compiled code is kept in `data_dir/code-cache`). A new
queue needs a reload (`kill -HUP`). Then:

```sh
khata enqueue @QUEUE@ '@PAYLOAD@'
```
"#;
