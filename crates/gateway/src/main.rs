//! The `sluice` command line (SPEC §1).

use std::path::PathBuf;
use std::process::ExitCode;

use clap::{Parser, Subcommand};
use sluice_gateway::logging::{self, LogFormat};
use sluice_gateway::server::{self, ConfigSource};

// The global allocator: jemalloc (default feature), mimalloc, or glibc's malloc with neither
// (docs/benchmarks.md). Both at once is a build error rather than a silent choice.
#[cfg(all(feature = "mimalloc", feature = "jemalloc"))]
compile_error!(
    "features `mimalloc` and `jemalloc` are exclusive: for mimalloc, build with \
     `--no-default-features --features mimalloc`"
);

#[cfg(all(feature = "mimalloc", not(feature = "jemalloc")))]
#[global_allocator]
static GLOBAL: mimalloc::MiMalloc = mimalloc::MiMalloc;

#[cfg(all(feature = "jemalloc", not(feature = "mimalloc")))]
#[global_allocator]
static GLOBAL: tikv_jemallocator::Jemalloc = tikv_jemallocator::Jemalloc;

#[derive(Parser)]
#[command(
    name = "sluice",
    version,
    about = "An egress gateway for outbound HTTP"
)]
struct Cli {
    /// Log line format.
    #[arg(long, global = true, value_enum, default_value_t = LogFormat::Json)]
    log_format: LogFormat,
    #[command(subcommand)]
    command: Command,
}

#[derive(Subcommand)]
enum Command {
    /// Run the gateway in the foreground (the embedded default config without --config).
    Run {
        /// The YAML config file.
        #[arg(short, long)]
        config: Option<PathBuf>,
    },
    /// Validate a config file without starting anything.
    Check {
        /// The YAML config file.
        #[arg(short, long)]
        config: PathBuf,
    },
    /// Run the embedded default with three demo upstreams and a client sending traffic.
    Demo,
}

fn main() -> ExitCode {
    let cli = Cli::parse();
    let (source, demo) = match &cli.command {
        Command::Check { config } => {
            return match server::load(&ConfigSource::File(config)) {
                Ok(_) => {
                    println!("ok");
                    ExitCode::SUCCESS
                }
                Err(errors) => {
                    eprintln!("{errors}");
                    ExitCode::from(1)
                }
            };
        }
        Command::Run { config: Some(path) } => (ConfigSource::File(path), false),
        Command::Run { config: None } => (ConfigSource::Embedded, false),
        Command::Demo => (ConfigSource::Embedded, true),
    };
    let (config, bytes) = match server::load(&source) {
        Ok(loaded) => loaded,
        Err(errors) => {
            eprintln!("{errors}");
            return ExitCode::from(1);
        }
    };
    logging::init(cli.log_format);
    if demo {
        sluice_gateway::demo::start(config.listen[0].addr);
    }
    let file = match &source {
        ConfigSource::File(path) => Some(path.to_path_buf()),
        ConfigSource::Embedded => None,
    };
    let result = server::run(config, bytes, file);
    logging::flush();
    match result {
        Ok(()) => ExitCode::SUCCESS,
        Err(error) => {
            eprintln!("sluice: {error}");
            ExitCode::from(1)
        }
    }
}
