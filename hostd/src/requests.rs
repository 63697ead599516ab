//! The request/reply loop shared by hostd's core-NATS services (`{p}.exec.<host>` and
//! `{p}.agent.<host>`): subscribe, hand each request to its own task, stop on shutdown.

use std::future::Future;

use async_nats::{Client, Message};
use futures::StreamExt;
use tokio_util::sync::CancellationToken;

use crate::error::HostdError;

/// Subscribes to `subject` and spawns `answer(message, reply_to)` for each request until
/// `shutdown`; a message without a reply subject is dropped with a warning. `what` names the
/// requests in logs and errors.
///
/// Errors: [`HostdError::Nats`] when the subscription cannot be made.
pub async fn serve<F, Fut>(
    nats: &Client,
    subject: String,
    what: &'static str,
    shutdown: CancellationToken,
    answer: F,
) -> Result<(), HostdError>
where
    F: Fn(Message, async_nats::Subject) -> Fut,
    Fut: Future<Output = ()> + Send + 'static,
{
    let mut requests = nats
        .subscribe(subject.clone())
        .await
        .map_err(HostdError::nats(what))?;
    tracing::info!(%subject, what, "serving requests");
    loop {
        tokio::select! {
            _ = shutdown.cancelled() => break,
            next = requests.next() => match next {
                Some(message) => match message.reply.clone() {
                    Some(reply_to) => {
                        tokio::spawn(answer(message, reply_to));
                    }
                    None => tracing::warn!(what, "request without a reply subject; dropped"),
                },
                None => break,
            },
        }
    }
    let _ = requests.unsubscribe().await;
    Ok(())
}
