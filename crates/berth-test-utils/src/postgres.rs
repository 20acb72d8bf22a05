//! A throwaway PostgreSQL database per test, on the server named by `BERTH_TEST_POSTGRES_URL`
//! (an admin URL, as `scripts/postgres.sh` prints it).
//!
//! [`TestDatabase`] works from synchronous and asynchronous tests alike: its statements run on
//! a thread of its own with a runtime of its own, so creating or dropping it never nests one
//! tokio runtime in another.

use sqlx::{Connection, Executor, PgConnection};

/// The variable naming the admin URL of the test PostgreSQL server.
pub const POSTGRES_URL_VAR: &str = "BERTH_TEST_POSTGRES_URL";

/// The admin URL from [`POSTGRES_URL_VAR`]; when it is unset, see [`crate::require_service`]
/// (a failure when services are required, `None` and a SKIP line otherwise).
pub fn admin_url(test: &str) -> Option<String> {
    std::env::var(POSTGRES_URL_VAR)
        .ok()
        .filter(|v| !v.is_empty())
        .or_else(|| {
            crate::require_service(
                test,
                &format!(
                    "{POSTGRES_URL_VAR} is not set (start PostgreSQL with `bash scripts/postgres.sh` \
                     and export its last line as {POSTGRES_URL_VAR})"
                ),
            )
        })
}

/// A database `berth_test_<random>` on the admin URL's server, dropped (with any connection
/// still open to it) when the guard goes.
#[derive(Debug)]
pub struct TestDatabase {
    pub admin_url: String,
    pub name: String,
    /// The admin URL with this database as its path.
    pub url: String,
}

impl TestDatabase {
    /// Creates the database; panics when the server cannot be reached.
    pub fn create(admin_url: &str) -> TestDatabase {
        let name = format!("berth_test_{}", uuid::Uuid::new_v4().simple());
        // DDL takes no bind parameters; the name is ours, made of [a-z0-9_] only.
        run_admin(admin_url, format!("CREATE DATABASE {name}"))
            .unwrap_or_else(|e| panic!("creating test database {name}: {e}"));
        TestDatabase {
            admin_url: admin_url.to_string(),
            url: with_database(admin_url, &name),
            name,
        }
    }
}

impl Drop for TestDatabase {
    fn drop(&mut self) {
        // FORCE ends connections (a server's pool) that may still be open or closing.
        let sql = format!("DROP DATABASE IF EXISTS {} WITH (FORCE)", self.name);
        if let Err(e) = run_admin(&self.admin_url, sql) {
            eprintln!("warning: could not drop test database {}: {e}", self.name);
        }
    }
}

/// Runs one statement on the admin URL, on a thread with its own runtime.
fn run_admin(admin_url: &str, sql: String) -> Result<(), String> {
    let admin_url = admin_url.to_string();
    std::thread::spawn(move || {
        let rt = tokio::runtime::Builder::new_current_thread()
            .enable_all()
            .build()
            .map_err(|e| format!("runtime: {e}"))?;
        rt.block_on(async {
            let mut admin = tokio::time::timeout(
                std::time::Duration::from_secs(20),
                PgConnection::connect(&admin_url),
            )
            .await
            .map_err(|_| "connecting to the admin url timed out".to_string())?
            .map_err(|e| format!("connecting to the admin url: {e}"))?;
            admin
                .execute(sql.as_str())
                .await
                .map_err(|e| format!("{sql}: {e}"))?;
            admin.close().await.ok();
            Ok(())
        })
    })
    .join()
    .map_err(|_| "the admin thread panicked".to_string())?
}

/// The admin URL with its database path replaced, keeping any query string.
pub fn with_database(url: &str, database: &str) -> String {
    let (base, query) = match url.split_once('?') {
        Some((base, query)) => (base, Some(query)),
        None => (url, None),
    };
    let scheme_end = base.find("://").map_or(0, |i| i + 3);
    let authority_end = base[scheme_end..]
        .find('/')
        .map_or(base.len(), |i| scheme_end + i);
    let mut out = format!("{}/{database}", &base[..authority_end]);
    if let Some(query) = query {
        out.push('?');
        out.push_str(query);
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn with_database_replaces_only_the_path() {
        assert_eq!(
            with_database("postgres://berth:berth@127.0.0.1:55432/postgres", "x"),
            "postgres://berth:berth@127.0.0.1:55432/x"
        );
        assert_eq!(
            with_database("postgres://h:1?sslmode=disable", "x"),
            "postgres://h:1/x?sslmode=disable"
        );
    }

    /// Needs the test PostgreSQL: the database exists while the guard lives, and not after.
    #[test]
    fn a_test_database_exists_until_dropped() {
        let Some(admin_url) = admin_url("a_test_database_exists_until_dropped") else {
            return;
        };
        let exists = |name: &str| {
            let (admin_url, name) = (admin_url.clone(), name.to_string());
            std::thread::spawn(move || {
                tokio::runtime::Builder::new_current_thread()
                    .enable_all()
                    .build()
                    .unwrap()
                    .block_on(async {
                        let mut c = PgConnection::connect(&admin_url).await.expect("connect");
                        let row: (bool,) = sqlx::query_as(
                            "SELECT EXISTS (SELECT 1 FROM pg_database WHERE datname = $1)",
                        )
                        .bind(&name)
                        .fetch_one(&mut c)
                        .await
                        .expect("query");
                        row.0
                    })
            })
            .join()
            .unwrap()
        };
        let db = TestDatabase::create(&admin_url);
        let name = db.name.clone();
        assert!(exists(&name), "{name} was not created");
        drop(db);
        assert!(!exists(&name), "{name} was not dropped");
    }
}
