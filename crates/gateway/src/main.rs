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

/// jemalloc's options, read when it starts, at the first allocation (the library's
/// `malloc_conf`; `_RJEM_MALLOC_CONF` in the environment still overrides them). A proxy thread
/// allocates in bursts: one turn reads the heads of every ready connection, then a later one
/// frees them all. jemalloc's thread cache keeps twice a slab's objects of a size, but no fewer
/// than `tcache_nslots_small_min`: 20 by default, which is what most sizes from 512 bytes up
/// get. A burst past that went to the arena's locked path both ways, and slabs were made and
/// unmade by the request. At least 64 a size keep a burst of 64 connections' buffers in the
/// cache. The cache's trim of what its bins did not use is looked at every
/// `tcache_gc_incr_bytes` allocated (at most every 10 ms): every 16 MiB rather than 64 KiB, so
/// that a busy thread, which allocates 64 KiB in a few requests, does not trim at every chance
/// (docs/benchmarks.md, "jemalloc's thread cache sized for a burst"). It costs a few MiB more
/// held per worker thread at most (docs/operations.md, "The allocator's thread caches").
#[cfg(all(feature = "jemalloc", not(feature = "mimalloc")))]
#[export_name = "_rjem_malloc_conf"]
static JEMALLOC_CONF: Option<&'static std::ffi::c_char> = Some(
    // SAFETY: a pointer to the first byte of a NUL-terminated static string, which is what
    // jemalloc reads this symbol as (a `const char *`).
    unsafe { &*JEMALLOC_OPTIONS.as_ptr() },
);

#[cfg(all(feature = "jemalloc", not(feature = "mimalloc")))]
const JEMALLOC_OPTIONS: &std::ffi::CStr =
    c"tcache_nslots_small_min:64,tcache_gc_incr_bytes:16777216";

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

#[cfg(all(test, feature = "jemalloc", not(feature = "mimalloc")))]
mod tests {
    use std::ffi::CStr;

    /// jemalloc's value of option `name` (`opt.*`), as the allocator this binary links runs it.
    fn opt<T: Copy + Default>(name: &CStr) -> T {
        let mut value = T::default();
        let mut len = std::mem::size_of::<T>();
        // SAFETY: a NUL-terminated name, and a buffer of the size given for the value read.
        let status = unsafe {
            tikv_jemalloc_sys::mallctl(
                name.as_ptr(),
                (&mut value as *mut T).cast(),
                &mut len,
                std::ptr::null_mut(),
                0,
            )
        };
        assert_eq!(status, 0, "mallctl {name:?}");
        assert_eq!(len, std::mem::size_of::<T>(), "{name:?}'s size");
        value
    }

    #[test]
    fn the_binary_runs_jemalloc_with_its_own_options() {
        if std::env::var_os("_RJEM_MALLOC_CONF").is_some() {
            // The environment is read after the binary's options, and wins.
            eprintln!("_RJEM_MALLOC_CONF is set: the binary's own options may be overridden");
            return;
        }
        // A misspelt option is no error to jemalloc (a warning on stderr, then its default),
        // so the values are read back.
        assert_eq!(opt::<u32>(c"opt.tcache_nslots_small_min"), 64);
        assert_eq!(opt::<usize>(c"opt.tcache_gc_incr_bytes"), 16 << 20);
        let text = super::JEMALLOC_OPTIONS.to_str().expect("ASCII");
        assert!(text.contains("tcache_nslots_small_min:64"), "{text}");
    }
}
