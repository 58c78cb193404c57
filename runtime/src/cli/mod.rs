//! The `khata` command line (docs/cli.md).
//!
//! One binary: `khata serve` and `khata check` hand over to the daemon
//! ([`crate::daemon`]); every other command is a small client of the daemon's
//! HTTP API (docs/api.md), built on [`Client`], which tests and benchmarks can reuse.
//!
//! Where the client finds the daemon: `--url` / `KHATA_URL` and `--token` /
//! `KHATA_TOKEN` when given; otherwise `[daemon] listen` and `token` /
//! `token_file` of the configuration file (`-c`, default `jobs.toml`) when it
//! exists; otherwise `http://127.0.0.1:7373` without a token.
//!
//! Exit codes: 0 success, 1 refused or failed (the server's `code: message`
//! on stderr, or a message naming the URL that could not be reached), 2 usage
//! error.

use std::fmt::Write as _;
use std::io::{self, Write as _};
use std::net::{IpAddr, Ipv4Addr, Ipv6Addr, SocketAddr};
use std::path::{Path, PathBuf};
use std::process::ExitCode;
use std::time::Duration;

use anyhow::Context as _;
use clap::builder::PossibleValue;
use clap::{Args, CommandFactory as _, Parser, Subcommand, ValueEnum};
use reqwest::{Method, RequestBuilder, StatusCode, Url};
use serde::{Deserialize, Serialize};
use serde_json::Value;

use crate::job::JobState;
use crate::store::{FenceState, Resolution};

/// The configuration file read when `-c/--config` is not given.
pub const DEFAULT_CONFIG: &str = "jobs.toml";

/// The daemon's address when neither `--url` nor a configuration file names it.
pub const DEFAULT_URL: &str = "http://127.0.0.1:7373";

/// How long the client waits for a TCP connection to the daemon.
const CONNECT_TIMEOUT: Duration = Duration::from_secs(10);

/// How long the client waits for a whole answer.
const REQUEST_TIMEOUT: Duration = Duration::from_secs(60);

/// Parses argv and runs the command; returns the process exit code (0
/// success, 1 refused/failed, 2 usage error).
pub fn main() -> ExitCode {
    run_from(std::env::args_os())
}

/// [`main`] with an explicit argument list (the first item is the program name).
fn run_from<I, T>(args: I) -> ExitCode
where
    I: IntoIterator<Item = T>,
    T: Into<std::ffi::OsString> + Clone,
{
    let cli = match Cli::try_parse_from(args) {
        Ok(cli) => cli,
        Err(err) => {
            // Help and version go to stdout with 0; real usage errors to
            // stderr with 2. A failure to print is not worth reporting.
            let _ = err.print();
            return ExitCode::from(u8::try_from(err.exit_code()).unwrap_or(2));
        }
    };
    match cli.run() {
        Ok(code) => code,
        Err(Failure::Usage(err)) => {
            let _ = err.print();
            ExitCode::from(2)
        }
        Err(Failure::Failed(err)) => {
            eprintln!("error: {err:#}");
            ExitCode::FAILURE
        }
    }
}

/// Why a command did not succeed.
#[derive(Debug)]
enum Failure {
    /// Bad arguments that clap could not see (a payload read from stdin).
    Usage(clap::Error),
    /// The server refused, the daemon was unreachable, or the local side failed.
    Failed(anyhow::Error),
}

impl From<anyhow::Error> for Failure {
    fn from(err: anyhow::Error) -> Self {
        Failure::Failed(err)
    }
}

impl From<ClientError> for Failure {
    fn from(err: ClientError) -> Self {
        Failure::Failed(err.into())
    }
}

impl Cli {
    fn run(self) -> Result<ExitCode, Failure> {
        let Cli { global, command } = self;
        match command {
            Command::Serve => {
                let config_path = global.config_path();
                crate::daemon::serve(&config_path)?;
                Ok(ExitCode::SUCCESS)
            }
            Command::Check => {
                let config_path = global.config_path();
                let valid = crate::daemon::check(&config_path)?;
                Ok(if valid {
                    ExitCode::SUCCESS
                } else {
                    ExitCode::FAILURE
                })
            }
            Command::Store {
                command: StoreCommand::Migrate,
            } => {
                crate::daemon::store_migrate(&global.config_path())?;
                Ok(ExitCode::SUCCESS)
            }
            Command::Verify(args) => {
                let options = crate::verify::Options {
                    plugin: args.plugin,
                    payload: args.payload,
                    queue: args.queue,
                    config: global.config_path(),
                    code_cache: if args.no_code_cache {
                        None
                    } else {
                        args.code_cache.or_else(crate::verify::default_code_cache)
                    },
                };
                match crate::verify::verify(&options) {
                    Ok(report) => {
                        let out = if args.output.json {
                            let mut text = serde_json::to_string_pretty(&report)
                                .context("cannot write the report as JSON")?;
                            text.push('\n');
                            text
                        } else {
                            report.render()
                        };
                        print_stdout(&out)?;
                        Ok(if report.findings.is_empty() {
                            ExitCode::SUCCESS
                        } else {
                            ExitCode::FAILURE
                        })
                    }
                    Err(crate::verify::VerifyError::Input(msg)) => {
                        eprintln!("error: {msg}");
                        Ok(ExitCode::from(2))
                    }
                    Err(crate::verify::VerifyError::Failed(msg)) => {
                        Err(Failure::Failed(anyhow::anyhow!(msg)))
                    }
                }
            }
            Command::New(args) => {
                match crate::scaffold::create(Path::new("."), &args.name, args.lang) {
                    Ok(created) => {
                        print_stdout(&created.render())?;
                        Ok(ExitCode::SUCCESS)
                    }
                    Err(crate::scaffold::ScaffoldError::Usage(msg)) => {
                        eprintln!("error: {msg}");
                        Ok(ExitCode::from(2))
                    }
                    Err(crate::scaffold::ScaffoldError::Failed(msg)) => {
                        Err(Failure::Failed(anyhow::anyhow!(msg)))
                    }
                }
            }
            Command::Store {
                command: StoreCommand::Copy(args),
            } => {
                let (from, to) = args.ledgers()?;
                crate::daemon::store_copy(&from, &to, args.page)?;
                Ok(ExitCode::SUCCESS)
            }
            command => {
                // Read stdin before talking to anyone, so that a bad payload
                // is a usage error whether or not the daemon is up.
                let enqueue_payload = match &command {
                    Command::Enqueue(args) => Some(args.payload()?),
                    _ => None,
                };
                let endpoint = global.endpoint()?;
                let client = Client::new(&endpoint.url, endpoint.token)?;
                let runtime = tokio::runtime::Builder::new_current_thread()
                    .enable_all()
                    .build()
                    .context("cannot start the async runtime")?;
                let out = runtime.block_on(run_client(&client, command, enqueue_payload))?;
                print_stdout(&out)?;
                Ok(ExitCode::SUCCESS)
            }
        }
    }
}

impl GlobalArgs {
    /// The configuration file: `-c` or `jobs.toml`.
    pub fn config_path(&self) -> PathBuf {
        self.config
            .clone()
            .unwrap_or_else(|| PathBuf::from(DEFAULT_CONFIG))
    }

    /// Where the client commands find the daemon; see [`resolve_endpoint`].
    pub fn endpoint(&self) -> anyhow::Result<Endpoint> {
        resolve_endpoint(
            self.url.as_deref(),
            self.token.as_deref(),
            self.config.as_deref(),
        )
    }
}

impl EnqueueArgs {
    /// The payload, read from stdin for `-`.
    fn payload(&self) -> Result<JsonText, Failure> {
        match &self.payload {
            PayloadArg::Json(value) => Ok(value.clone()),
            PayloadArg::Stdin => {
                let text = io::read_to_string(io::stdin())
                    .context("cannot read PAYLOAD_JSON from stdin")?;
                JsonText::parse(&text).map_err(|err| {
                    let mut cli = Cli::command();
                    cli.build();
                    let enqueue = cli
                        .find_subcommand_mut("enqueue")
                        .expect("enqueue is a subcommand");
                    Failure::Usage(enqueue.error(
                        clap::error::ErrorKind::ValueValidation,
                        format!(
                            "invalid value for '[PAYLOAD_JSON]' (read from stdin): not JSON: {err}"
                        ),
                    ))
                })
            }
        }
    }

    /// The API's enqueue body.
    fn request(&self, payload: JsonText) -> EnqueueRequest {
        EnqueueRequest {
            payload,
            id: self.id.clone(),
            dedup_key: self.dedup_key.clone(),
            dedup_for: self.dedup_for.clone(),
            delay: self.delay.clone(),
            run_at: self.run_at.clone(),
            priority: self.priority,
            max_attempts: self.max_attempts,
        }
    }
}

/// Runs one client command; returns what to print on stdout.
async fn run_client(
    client: &Client,
    command: Command,
    enqueue_payload: Option<JsonText>,
) -> Result<String, ClientError> {
    let out = match command {
        Command::Enqueue(args) => {
            let payload = enqueue_payload.unwrap_or_default();
            let answer = client.enqueue(&args.queue, &args.request(payload)).await?;
            if args.output.json {
                pretty(&answer)
            } else {
                let mut line = text(&answer["job"]["id"]);
                if answer["deduplicated"].as_bool() == Some(true) {
                    line.push_str(" (deduplicated)");
                }
                line + "\n"
            }
        }
        Command::Job { id, output } => {
            let job = client.job(&id).await?;
            if output.json {
                pretty(&job)
            } else {
                render_job(&job)
            }
        }
        Command::Jobs(args) => {
            let query = JobsQuery {
                queue: args.queue,
                state: args.state.map(|s| s.as_str().to_owned()),
                limit: args.limit,
                cursor: args.cursor,
            };
            let page = client.jobs(&query).await?;
            if args.output.json {
                pretty(&page)
            } else {
                render_jobs(&page)
            }
        }
        Command::Retry { id, output } => {
            let answer = client.retry(&id).await?;
            if output.json {
                pretty(&answer)
            } else {
                render_job_state(&answer["job"], &id)
            }
        }
        Command::Cancel { id, output } => {
            let answer = client.cancel(&id).await?;
            if output.json {
                pretty(&answer)
            } else {
                render_job_state(&answer["job"], &id)
            }
        }
        Command::Queues { output } => {
            let answer = client.queues().await?;
            if output.json {
                pretty(&answer)
            } else {
                render_queues(&answer)
            }
        }
        Command::Schedules { output } => {
            let answer = client.schedules().await?;
            if output.json {
                pretty(&answer)
            } else {
                render_schedules(&answer)
            }
        }
        Command::Fences(args) => {
            let answer = client
                .fences(
                    args.namespace.as_deref(),
                    args.state.map(FenceState::as_str),
                )
                .await?;
            if args.output.json {
                pretty(&answer)
            } else {
                render_fences(&answer)
            }
        }
        Command::Fence {
            command:
                FenceCommand::Resolve {
                    namespace,
                    kind,
                    key,
                    outcome,
                },
        } => {
            client
                .resolve_fence(&namespace, &kind, &key, outcome)
                .await?;
            format!(
                "fence {namespace}/{kind}/{key} resolved as {}\n",
                outcome.as_str()
            )
        }
        Command::Serve
        | Command::Check
        | Command::Store { .. }
        | Command::Verify(_)
        | Command::New(_) => {
            unreachable!("handled without a client")
        }
    };
    Ok(out)
}

/// Writes to stdout; a closed pipe (`khata jobs | head`) is not an error.
fn print_stdout(out: &str) -> anyhow::Result<()> {
    let mut stdout = io::stdout().lock();
    match stdout
        .write_all(out.as_bytes())
        .and_then(|()| stdout.flush())
    {
        Err(err) if err.kind() != io::ErrorKind::BrokenPipe => {
            Err(err).context("cannot write to stdout")
        }
        _ => Ok(()),
    }
}

mod args;
mod client;
mod render;

pub use self::args::*;
pub use self::client::*;
use self::render::*;

#[cfg(test)]
mod tests;
