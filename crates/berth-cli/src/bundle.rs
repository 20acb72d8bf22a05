//! `berth bundle`: seed 001 bundles. `build` packs a directory into the deterministic tar that
//! `berth-bundle` defines and prints its sha, the name a bundle is published and fetched by.
//! No server is involved; `push` (sending a built tar to the server) belongs here too.

use std::path::{Path, PathBuf};

use anyhow::Context;
use clap::{Args, Subcommand};

#[derive(Subcommand, Debug)]
pub enum BundleCommand {
    /// Pack DIR (regular files only; links and devices are refused) into a bundle tar and print
    /// its sha.
    Build(BuildArgs),
    /// Push a bundle (a tar, as `berth bundle build` makes it) to an environment; prints its sha.
    Push {
        file: PathBuf,
        #[arg(long = "env")]
        environment: String,
    },
}

#[derive(Args, Debug)]
pub struct BuildArgs {
    /// The directory holding the compose file, `.env.template`, `secrets.manifest.json` and
    /// `bundle.json`.
    pub dir: PathBuf,
    // `-o` is already the global `--output` format, hence `--out` (as `berth man --out`).
    /// Where to write the tar (default: `bundle-<first 12 of the sha>.tar` in the current
    /// directory).
    #[arg(long, value_name = "FILE")]
    pub out: Option<PathBuf>,
}

/// What `build` made: the tar's path and the bundle sha.
pub struct Built {
    pub file: PathBuf,
    pub sha: String,
}

/// Packs `args.dir` and writes the tar. Refusals carry the bundle code (`BUNDLE_UNSAFE: …`).
pub fn build(args: &BuildArgs) -> anyhow::Result<Built> {
    let (_, tar, sha) = berth_bundle::build_dir(&args.dir)
        .with_context(|| format!("packing {}", args.dir.display()))?;
    let file = args
        .out
        .clone()
        .unwrap_or_else(|| Path::new(&format!("bundle-{}.tar", &sha[..12])).to_path_buf());
    std::fs::write(&file, &tar).with_context(|| format!("writing {}", file.display()))?;
    Ok(Built { file, sha })
}
