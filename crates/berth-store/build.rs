//! `sqlx::migrate!` embeds the migration files it finds at compile time, but on stable Rust a
//! new file in `migrations/` does not make cargo compile this crate again (only a changed one
//! does). Watching the directory does (sqlx's `migrate build-script`).
fn main() {
    println!("cargo:rerun-if-changed=migrations");
}
