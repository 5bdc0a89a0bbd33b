//! What ferrorun and the `ferroccl-*` tools share of their command lines. Each binary
//! includes this file as a module (`#[path = "cli_support.rs"] mod cli_support;`).

use std::io::{ErrorKind, Write};
use std::process::ExitCode;

use clap::CommandFactory;
use clap_complete::Shell;

/// Writes the completion script of `C` (named as its command is) for `shell` to
/// standard output: `--completions SHELL`. A reader that stops early (`| head`) ends
/// the tool quietly with status 1; any other write error is printed.
pub fn print_completions<C: CommandFactory>(shell: Shell) -> ExitCode {
    let mut command = C::command();
    let name = command.get_name().to_owned();
    let mut script = Vec::new();
    clap_complete::generate(shell, &mut command, name, &mut script);
    write_stdout(&script, "the completion script")
}

/// Writes `bytes` (`what`, for the error message) to standard output: status 0, or 1
/// quietly when the reader stopped early (`| head`), or 1 with the error printed.
pub fn write_stdout(bytes: &[u8], what: &str) -> ExitCode {
    match std::io::stdout().lock().write_all(bytes) {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) if e.kind() == ErrorKind::BrokenPipe => ExitCode::FAILURE,
        Err(e) => {
            eprintln!("writing {what}: {e}");
            ExitCode::FAILURE
        }
    }
}
