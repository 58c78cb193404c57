//! `khata-build-c`: builds a khata job handler written in C into a
//! component that the daemon loads.
//!
//! ```text
//! khata-build-c HANDLER.c [MORE.c ...] -o OUT.wasm
//! ```
//!
//! 1. C bindings of `wit/khata.wit`'s world `handler` (wit-bindgen's C
//!    generator) and the SDK's `khata.h`/`khata.c`, all embedded in this
//!    binary, are written to a temporary directory;
//! 2. clang (`$CC`, else the first of `clang`, `clang-19`, `clang-18`,
//!    `clang-17`, `clang-16` on `PATH`) compiles and links them with the
//!    handler's sources for `wasm32-wasi` against wasi-libc, as a reactor
//!    (a module whose exports are called, not a `main`);
//! 3. the core module becomes a component with wasmtime's WASI preview1
//!    adapter. The component imports only the khata interfaces whose
//!    functions the handler calls (the linker keeps no other import), so its
//!    queue needs only those grants.

use std::collections::BTreeSet;
use std::path::{Path, PathBuf};
use std::process::{Command, ExitCode};

use anyhow::{Context, Result, bail};
use wasi_preview1_component_adapter_provider::{
    WASI_SNAPSHOT_PREVIEW1_ADAPTER_NAME, WASI_SNAPSHOT_PREVIEW1_REACTOR_ADAPTER,
};
use wit_bindgen_core::Files;
use wit_bindgen_core::wit_parser::Resolve;

const WIT: &str = include_str!("../../../../wit/khata.wit");
const KHATA_H: &str = include_str!("../../khata.h");
const KHATA_C: &str = include_str!("../../khata.c");
/// The compilers tried, in order, when `$CC` is not set.
const COMPILERS: [&str; 5] = ["clang", "clang-19", "clang-18", "clang-17", "clang-16"];
const KHATA_IMPORT_PREFIX: &str = "khata:plugin/";

const USAGE: &str = "usage: khata-build-c HANDLER.c [MORE.c ...] -o OUT.wasm";

struct Args {
    sources: Vec<PathBuf>,
    output: PathBuf,
}

fn parse_args(args: impl Iterator<Item = String>) -> Result<Args> {
    let mut sources = Vec::new();
    let mut output = None;
    let mut args = args;
    while let Some(arg) = args.next() {
        match arg.as_str() {
            "-o" | "--output" => {
                let value = args.next().with_context(|| format!("{arg} needs a path"))?;
                output = Some(PathBuf::from(value));
            }
            "-h" | "--help" => bail!("{USAGE}"),
            other if other.starts_with('-') => bail!("unknown option {other}\n{USAGE}"),
            source => sources.push(PathBuf::from(source)),
        }
    }
    if sources.is_empty() {
        bail!("no C source given\n{USAGE}");
    }
    let output = output.with_context(|| format!("no output given (-o OUT.wasm)\n{USAGE}"))?;
    for source in &sources {
        if !source.is_file() {
            bail!("{}: no such file", source.display());
        }
    }
    Ok(Args { sources, output })
}

fn main() -> ExitCode {
    match parse_args(std::env::args().skip(1)).and_then(|args| build(&args)) {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("khata-build-c: {e:#}");
            ExitCode::FAILURE
        }
    }
}

fn build(args: &Args) -> Result<()> {
    let dir = tempfile::tempdir().context("creating a temporary directory")?;
    write_bindings(dir.path())?;
    std::fs::write(dir.path().join("khata.h"), KHATA_H)?;
    std::fs::write(dir.path().join("khata.c"), KHATA_C)?;

    let core = dir.path().join("core.wasm");
    compile(dir.path(), &args.sources, &core)?;
    let module = std::fs::read(&core).with_context(|| format!("reading {}", core.display()))?;
    let imports = khata_imports(&module)?;
    let component = wit_component::ComponentEncoder::default()
        .validate(true)
        .module(&module)
        .context("the linked module carries no khata world")?
        .adapter(
            WASI_SNAPSHOT_PREVIEW1_ADAPTER_NAME,
            WASI_SNAPSHOT_PREVIEW1_REACTOR_ADAPTER,
        )
        .context("adding the WASI adapter")?
        .encode()
        .context("making the component")?;

    // Written beside the output and renamed, so that a daemon watching the
    // directory never loads half a file.
    let partial = args.output.with_extension("wasm.partial");
    std::fs::write(&partial, &component)
        .with_context(|| format!("writing {}", partial.display()))?;
    std::fs::rename(&partial, &args.output)
        .with_context(|| format!("writing {}", args.output.display()))?;
    let imports: Vec<&str> = imports.iter().map(String::as_str).collect();
    println!(
        "built {} ({} bytes), importing khata {}",
        args.output.display(),
        component.len(),
        if imports.is_empty() {
            "nothing".to_owned()
        } else {
            imports.join(", ")
        }
    );
    Ok(())
}

/// Writes wit-bindgen's C bindings of the world `handler`: `handler.h`,
/// `handler.c` and `handler_component_type.o` (the world's type, which the
/// linker keeps in the module for the component encoder).
fn write_bindings(dir: &Path) -> Result<()> {
    let mut resolve = Resolve::default();
    let package = resolve
        .push_source("khata.wit", WIT)
        .context("parsing the embedded khata.wit")?;
    let world = resolve.select_world(&[package], Some("handler"))?;
    let mut files = Files::default();
    wit_bindgen_c::Opts::default()
        .build()
        .generate(&mut resolve, world, &mut files)
        .context("generating the C bindings")?;
    for (name, contents) in files.iter() {
        std::fs::write(dir.join(name), contents).with_context(|| format!("writing {name}"))?;
    }
    Ok(())
}

fn compiler() -> Result<String> {
    if let Ok(cc) = std::env::var("CC")
        && !cc.is_empty()
    {
        return Ok(cc);
    }
    for cc in COMPILERS {
        if Command::new(cc).arg("--version").output().is_ok() {
            return Ok(cc.to_owned());
        }
    }
    bail!(
        "no clang found (tried {}; set CC to one): install clang, lld and wasi-libc \
         (Debian: apt-get install clang-16 lld-16 wasi-libc libclang-rt-16-dev-wasm32)",
        COMPILERS.join(", ")
    )
}

fn compile(dir: &Path, sources: &[PathBuf], core: &Path) -> Result<()> {
    let cc = compiler()?;
    let mut command = Command::new(&cc);
    command
        .args([
            "--target=wasm32-wasi",
            "-mexec-model=reactor",
            "-std=c11",
            "-O2",
            "-Wall",
        ])
        .arg("-I")
        .arg(dir)
        .args(sources)
        .arg(dir.join("handler.c"))
        .arg(dir.join("khata.c"))
        .arg(dir.join("handler_component_type.o"))
        .arg("-o")
        .arg(core);
    let status = command.status().with_context(|| format!("running {cc}"))?;
    if !status.success() {
        bail!(
            "{cc} failed ({status}); it needs wasi-libc and the wasm32 builtins \
             (Debian: apt-get install lld-16 wasi-libc libclang-rt-16-dev-wasm32)"
        );
    }
    Ok(())
}

/// The khata interfaces the module imports, such as `kv` and `email`.
fn khata_imports(module: &[u8]) -> Result<BTreeSet<String>> {
    let mut names = BTreeSet::new();
    for payload in wasmparser::Parser::new(0).parse_all(module) {
        if let wasmparser::Payload::ImportSection(section) = payload? {
            for import in section.into_imports() {
                let import = import?;
                if let Some(rest) = import.module.strip_prefix(KHATA_IMPORT_PREFIX) {
                    let name = rest.split('@').next().unwrap_or(rest);
                    names.insert(name.to_owned());
                }
            }
        }
    }
    Ok(names)
}
