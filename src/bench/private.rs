//! The place of a self-contained bench mode (`--runtime sim`, `--failover`) on the servers: a
//! database of its own, created on `DATABASE_URL`'s server (or on a private Postgres started
//! in the state dir when none is given), NATS (`NATS_URL`, or a private `nats-server`) with a
//! subject prefix of its own; all of it dropped by [`Private::close`].

use std::path::Path;

use anyhow::Context;
use tokio_util::sync::CancellationToken;

use crate::dev::{start_private_nats, start_private_postgres, PrivateService};

/// A bench's own database and subject prefix, and the private servers it started.
pub(super) struct Private {
    /// The database's name and the subject prefix: `<kind><pid>`.
    pub tag: String,
    /// The bench's own database.
    pub database_url: String,
    pub nats_url: String,
    pub subjects: berth_schemas::Subjects,
    /// A connection to the server's `DATABASE_URL` database, to drop the bench's.
    admin: sqlx::PgPool,
    /// Started here, stopped (in reverse) by [`Private::close`].
    services: Vec<PrivateService>,
}

impl Private {
    /// Starts what is not given (a private Postgres in `<state_dir>/postgres`, a private
    /// nats-server in `<state_dir>/nats`) and creates the database `<kind><pid>`.
    ///
    /// Errors: a private server that did not start, the server unreachable, the database not
    /// created (what was started is stopped again first).
    pub async fn open(
        kind: &str,
        state_dir: &Path,
        database_url: Option<&str>,
        nats_url: Option<&str>,
        shutdown: &CancellationToken,
    ) -> anyhow::Result<Self> {
        let mut services = Vec::new();
        let opened = Self::open_on(
            kind,
            state_dir,
            database_url,
            nats_url,
            shutdown,
            &mut services,
        )
        .await;
        match opened {
            Ok((tag, server_url, nats_url, admin)) => Ok(Private {
                database_url: with_database(&server_url, &tag)?,
                subjects: berth_schemas::Subjects::new(&tag)?,
                tag,
                nats_url,
                admin,
                services,
            }),
            Err(e) => {
                for s in services.into_iter().rev() {
                    s.stop().await;
                }
                Err(e)
            }
        }
    }

    async fn open_on(
        kind: &str,
        state_dir: &Path,
        database_url: Option<&str>,
        nats_url: Option<&str>,
        shutdown: &CancellationToken,
        services: &mut Vec<PrivateService>,
    ) -> anyhow::Result<(String, String, String, sqlx::PgPool)> {
        let server_url = match database_url {
            Some(url) => url.to_owned(),
            None => {
                let (url, svc) = start_private_postgres(state_dir, shutdown).await?;
                services.push(svc);
                url
            }
        };
        let nats_url = match nats_url {
            Some(url) => url.to_owned(),
            None => {
                let (url, svc) = start_private_nats(state_dir, None, shutdown).await?;
                services.push(svc);
                url
            }
        };
        let tag = format!("{kind}{}", std::process::id());
        let admin = crate::connect_db(&server_url).await?;
        sqlx::query(&format!("CREATE DATABASE {tag}"))
            .execute(&admin)
            .await
            .context("create the bench database")?;
        Ok((tag, server_url, nats_url, admin))
    }

    /// Deletes the streams of the bench's prefix, drops its database (unless `keep_database`:
    /// then its URL is printed) and stops the private servers. Best effort: what fails is
    /// printed.
    pub async fn close(self, keep_database: bool) {
        match crate::connect_nats(&self.nats_url).await {
            Ok(nats) => {
                let js = async_nats::jetstream::new(nats);
                berth_schemas::streams::delete_streams(&js, &self.subjects).await;
            }
            Err(e) => eprintln!("streams of {} not deleted: {e:#}", self.tag),
        }
        if keep_database {
            eprintln!("kept the database: {}", self.database_url);
        } else if let Err(e) = sqlx::query(&format!("DROP DATABASE {} WITH (FORCE)", self.tag))
            .execute(&self.admin)
            .await
        {
            eprintln!("database {} not dropped: {e}", self.tag);
        }
        self.admin.close().await;
        for s in self.services.into_iter().rev() {
            s.stop().await;
        }
    }
}

/// `url` with its database name replaced by `name`.
fn with_database(url: &str, name: &str) -> anyhow::Result<String> {
    let (base, _) = url.rsplit_once('/').context("a Postgres URL has a path")?;
    Ok(format!("{base}/{name}"))
}
