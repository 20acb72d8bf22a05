//! `completions` and `man` for both binaries. They are generated from the clap definitions when
//! run, so they cannot drift from the flags; scripts/package.sh runs them to put the files into
//! the Debian packages.

use std::io::Write;
use std::path::PathBuf;

use clap::Subcommand;
use clap_complete::Shell;

#[derive(Subcommand, Debug, Clone)]
pub enum DocsCommand {
    /// Print a shell completion script, e.g. `completions bash > /etc/bash_completion.d/NAME`.
    Completions {
        #[arg(value_enum)]
        shell: Shell,
    },
    /// Write man pages: with --out, NAME.1 and one page per subcommand (NAME-SUB.1) into DIR;
    /// without, NAME.1 to standard output (`man -l -`).
    Man {
        #[arg(long, value_name = "DIR")]
        out: Option<PathBuf>,
    },
}

/// Runs `docs` for `cmd`, the program's full clap command (`Cli::command()`).
pub fn run(mut cmd: clap::Command, docs: DocsCommand) -> std::io::Result<()> {
    match docs {
        DocsCommand::Completions { shell } => {
            let name = cmd.get_name().to_string();
            // Into memory first: clap_complete panics on a write error (a closed pipe).
            let mut script = Vec::new();
            clap_complete::generate(shell, &mut cmd, name, &mut script);
            let mut stdout = std::io::stdout().lock();
            stdout.write_all(&script)?;
            stdout.flush()
        }
        DocsCommand::Man { out: Some(dir) } => {
            std::fs::create_dir_all(&dir)?;
            clap_mangen::generate_to(cmd, &dir)
        }
        DocsCommand::Man { out: None } => {
            let mut stdout = std::io::stdout().lock();
            clap_mangen::Man::new(cmd).render(&mut stdout)?;
            stdout.flush()
        }
    }
}
