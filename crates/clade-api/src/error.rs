//! Errors as HTTP: an operation's failure kind as its status (`clade_http::status`), with a JSON body
//! `{"error": {"code", "message"}}`. A malformed JSON body is a 400 whose message names the field; one over
//! [`JSON_LIMIT`] is a 413.

use axum::extract::rejection::JsonRejection;
use axum::extract::{FromRequest, Request};
use axum::http::StatusCode;
use axum::response::{IntoResponse, Response};
use serde::de::DeserializeOwned;

/// The largest JSON body accepted (axum's default body limit, which the JSON extractor applies).
pub const JSON_LIMIT: usize = 2 << 20;

pub fn error_body(code: &str, message: &str) -> serde_json::Value {
    serde_json::json!({"error": {"code": code, "message": message}})
}

/// An operation's failure, carried to the client.
pub struct ApiError {
    pub status: StatusCode,
    pub code: &'static str,
    pub message: String,
}

impl ApiError {
    pub fn new(status: StatusCode, code: &'static str, message: impl Into<String>) -> Self {
        ApiError { status, code, message: message.into() }
    }
    pub fn bad_request(message: impl Into<String>) -> Self {
        ApiError::new(StatusCode::BAD_REQUEST, "bad_request", message)
    }
}

impl From<anyhow::Error> for ApiError {
    fn from(e: anyhow::Error) -> Self {
        let kind = if e.chain().any(|c| c.is::<crate::exec::ExecTimedOut>()) {
            clade_core::ErrorKind::Timeout
        } else {
            clade_host::error::kind(&e)
        };
        let (status, code) = crate::status::status_of(kind);
        let status = StatusCode::from_u16(status).unwrap_or(StatusCode::INTERNAL_SERVER_ERROR);
        ApiError { status, code, message: format!("{e:#}") }
    }
}

impl From<tokio::task::JoinError> for ApiError {
    fn from(e: tokio::task::JoinError) -> Self {
        if e.is_cancelled() {
            // A blocking operation is cancelled only before it started, by the daemon's shutdown: nothing was
            // done, and the request may be sent again to the next daemon (503 is HTTP's "retry later").
            return ApiError::new(
                StatusCode::SERVICE_UNAVAILABLE,
                "stopping",
                "the daemon is stopping and did not start this operation; nothing was done: send it again",
            );
        }
        ApiError::new(StatusCode::INTERNAL_SERVER_ERROR, "internal", format!("the operation's thread failed: {e}"))
    }
}

impl IntoResponse for ApiError {
    fn into_response(self) -> Response {
        (self.status, axum::Json(error_body(self.code, &self.message))).into_response()
    }
}

/// `axum::Json`, with a rejection that is always a 400 naming what was wrong (serde names the field).
pub struct Body<T>(pub T);

impl<S: Send + Sync, T: DeserializeOwned> FromRequest<S> for Body<T> {
    type Rejection = ApiError;

    async fn from_request(req: Request, state: &S) -> Result<Self, Self::Rejection> {
        // An empty body means "all defaults" where the type allows it.
        let empty = req
            .headers()
            .get(axum::http::header::CONTENT_LENGTH)
            .and_then(|v| v.to_str().ok())
            .is_some_and(|v| v == "0");
        if empty {
            return serde_json::from_slice(b"{}")
                .map(Body)
                .map_err(|e| ApiError::bad_request(format!("request body: {e}")));
        }
        match axum::Json::<T>::from_request(req, state).await {
            Ok(axum::Json(v)) => Ok(Body(v)),
            Err(JsonRejection::MissingJsonContentType(_)) => {
                Err(ApiError::bad_request("request body: Content-Type must be application/json"))
            }
            // Past the JSON body limit (axum's DefaultBodyLimit, 2 MiB): 413, so a client knows to send less
            // rather than to fix its syntax.
            Err(e) if e.status() == StatusCode::PAYLOAD_TOO_LARGE => Err(ApiError::new(
                StatusCode::PAYLOAD_TOO_LARGE,
                "too_large",
                format!("request body: larger than the {} MiB a JSON body may be", JSON_LIMIT >> 20),
            )),
            Err(e) => Err(ApiError::bad_request(format!("request body: {}", e.body_text()))),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use clade_core::admission::Resource;
    use clade_core::ErrorKind;

    #[test]
    fn admission_refusals_are_429_or_507() {
        let refused = |resource| {
            let e = clade_host::error::kinded(ErrorKind::of_resource(resource), "memory: needs 1 GiB");
            ApiError::from(e.context("fork"))
        };
        let mem = refused(Resource::Memory);
        assert_eq!((mem.status, mem.code), (StatusCode::TOO_MANY_REQUESTS, "no_capacity"));
        assert!(mem.message.contains("memory: needs"), "{}", mem.message);
        assert_eq!(refused(Resource::Cpu).status, StatusCode::TOO_MANY_REQUESTS);
        assert_eq!(refused(Resource::Disk).status, StatusCode::INSUFFICIENT_STORAGE);
    }

    #[test]
    fn a_cancelled_operation_is_503_stopping_and_a_panic_500() {
        let rt = tokio::runtime::Builder::new_current_thread().enable_time().build().unwrap();
        let (cancelled, panicked) = rt.block_on(async {
            let pending = tokio::spawn(async { tokio::time::sleep(std::time::Duration::from_secs(60)).await });
            pending.abort();
            let panics = tokio::spawn(async { panic!("boom") });
            (pending.await.unwrap_err(), panics.await.unwrap_err())
        });
        let c = ApiError::from(cancelled);
        assert_eq!((c.status, c.code), (StatusCode::SERVICE_UNAVAILABLE, "stopping"));
        assert!(c.message.contains("nothing was done"), "{}", c.message);
        let p = ApiError::from(panicked);
        assert_eq!((p.status, p.code), (StatusCode::INTERNAL_SERVER_ERROR, "internal"));
    }
}
