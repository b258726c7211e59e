//! The Connect protocol (connectrpc.com/docs/protocol) with the JSON codec, as envd's clients speak it over
//! HTTP/1.1 or h2c: unary calls are a plain JSON body each way (`application/json`); streaming calls carry
//! enveloped messages (`application/connect+json`: a flags byte, a big-endian u32 length, the JSON), and a
//! server stream ends with an end-of-stream envelope (flags `0x02`) holding `{}` or `{"error": ...}`.

use axum::body::Body;
use axum::http::{header, HeaderValue, StatusCode};
use axum::response::{IntoResponse, Response};
use bytes::{Buf, BufMut, Bytes, BytesMut};
use futures_util::{Stream, StreamExt};
use serde::de::DeserializeOwned;

use crate::host::HostError;

pub const FLAG_END: u8 = 0x02;
pub const FLAG_COMPRESSED: u8 = 0x01;
/// Largest request message accepted (requests are small; file bytes go over /files).
pub const MAX_MESSAGE: usize = 16 << 20;

/// A Connect error code.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Code {
    Canceled,
    Unknown,
    InvalidArgument,
    DeadlineExceeded,
    NotFound,
    AlreadyExists,
    PermissionDenied,
    ResourceExhausted,
    FailedPrecondition,
    Unimplemented,
    Internal,
    Unavailable,
    Unauthenticated,
}

impl Code {
    pub fn as_str(self) -> &'static str {
        match self {
            Code::Canceled => "canceled",
            Code::Unknown => "unknown",
            Code::InvalidArgument => "invalid_argument",
            Code::DeadlineExceeded => "deadline_exceeded",
            Code::NotFound => "not_found",
            Code::AlreadyExists => "already_exists",
            Code::PermissionDenied => "permission_denied",
            Code::ResourceExhausted => "resource_exhausted",
            Code::FailedPrecondition => "failed_precondition",
            Code::Unimplemented => "unimplemented",
            Code::Internal => "internal",
            Code::Unavailable => "unavailable",
            Code::Unauthenticated => "unauthenticated",
        }
    }

    /// The HTTP status of a unary error with this code (the protocol's table).
    pub fn http(self) -> StatusCode {
        match self {
            Code::Canceled => StatusCode::from_u16(499).unwrap_or(StatusCode::BAD_REQUEST),
            Code::Unknown | Code::Internal => StatusCode::INTERNAL_SERVER_ERROR,
            Code::InvalidArgument | Code::FailedPrecondition => StatusCode::BAD_REQUEST,
            Code::DeadlineExceeded => StatusCode::GATEWAY_TIMEOUT,
            Code::NotFound => StatusCode::NOT_FOUND,
            Code::AlreadyExists => StatusCode::CONFLICT,
            Code::PermissionDenied => StatusCode::FORBIDDEN,
            Code::ResourceExhausted => StatusCode::TOO_MANY_REQUESTS,
            Code::Unimplemented => StatusCode::NOT_IMPLEMENTED,
            Code::Unavailable => StatusCode::SERVICE_UNAVAILABLE,
            Code::Unauthenticated => StatusCode::UNAUTHORIZED,
        }
    }
}

/// An RPC failure.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct RpcError {
    pub code: Code,
    pub message: String,
    /// In a server stream: cut the response instead of ending it with this error, as the connection to a
    /// sandbox that went away is cut in E2B (the SDKs then ask `/health` whether it is gone).
    pub cut: bool,
}

impl RpcError {
    pub fn new(code: Code, message: impl Into<String>) -> RpcError {
        RpcError { code, message: message.into(), cut: false }
    }
    /// A stream that ends by its connection being cut (see [`RpcError::cut`]).
    pub fn cut(message: impl Into<String>) -> RpcError {
        RpcError { cut: true, ..RpcError::new(Code::Unavailable, message) }
    }
    pub fn json(&self) -> serde_json::Value {
        serde_json::json!({"code": self.code.as_str(), "message": self.message})
    }
}

impl From<HostError> for RpcError {
    fn from(e: HostError) -> RpcError {
        let code = match &e {
            HostError::NotFound(_) => Code::NotFound,
            HostError::Invalid(_) => Code::InvalidArgument,
            HostError::Conflict(_) => Code::AlreadyExists,
            HostError::Permission(_) => Code::PermissionDenied,
            HostError::NoSpace(_) => Code::ResourceExhausted,
            HostError::Internal(_) => Code::Internal,
        };
        RpcError::new(code, e.to_string())
    }
}

/// The answer to a unary call.
pub fn unary(result: Result<serde_json::Value, RpcError>) -> Response {
    match result {
        Ok(v) => ([(header::CONTENT_TYPE, "application/json")], v.to_string()).into_response(),
        Err(e) => (e.code.http(), [(header::CONTENT_TYPE, "application/json")], e.json().to_string()).into_response(),
    }
}

/// Whether a request is a streaming one (enveloped body).
pub fn is_streaming(content_type: Option<&HeaderValue>) -> bool {
    content_type.and_then(|v| v.to_str().ok()).is_some_and(|s| s.starts_with("application/connect+"))
}

/// One envelope.
pub fn envelope(flags: u8, json: &[u8]) -> Bytes {
    let mut b = BytesMut::with_capacity(5 + json.len());
    b.put_u8(flags);
    b.put_u32(json.len() as u32);
    b.put_slice(json);
    b.freeze()
}

/// Splits enveloped messages off the front of `buf`: complete ones are returned, the rest stays.
pub fn take_envelopes(buf: &mut BytesMut) -> Result<Vec<(u8, Bytes)>, RpcError> {
    let mut out = Vec::new();
    loop {
        if buf.len() < 5 {
            return Ok(out);
        }
        let flags = buf[0];
        let len = u32::from_be_bytes([buf[1], buf[2], buf[3], buf[4]]) as usize;
        if len > MAX_MESSAGE {
            return Err(RpcError::new(Code::ResourceExhausted, format!("message of {len} bytes is too large")));
        }
        if flags & FLAG_COMPRESSED != 0 {
            return Err(RpcError::new(Code::Unimplemented, "compressed messages are not supported: send identity"));
        }
        if buf.len() < 5 + len {
            return Ok(out);
        }
        buf.advance(5);
        out.push((flags, buf.split_to(len).freeze()));
    }
}

/// Decode a request message: a unary body, or the first envelope of a streaming one.
pub fn decode_request<T: DeserializeOwned>(streaming: bool, body: &[u8]) -> Result<T, RpcError> {
    let json: Bytes = if streaming {
        let mut b = BytesMut::from(body);
        match take_envelopes(&mut b)?.into_iter().next() {
            Some((_, m)) => m,
            None => return Err(RpcError::new(Code::InvalidArgument, "the request has no message")),
        }
    } else {
        Bytes::copy_from_slice(body)
    };
    let json: &[u8] = if json.is_empty() { b"{}" } else { &json };
    serde_json::from_slice(json).map_err(|e| RpcError::new(Code::InvalidArgument, format!("bad request message: {e}")))
}

/// A server-streaming answer: each message enveloped, then the end-of-stream envelope.
pub fn server_stream(messages: impl Stream<Item = Result<serde_json::Value, RpcError>> + Send + 'static) -> Response {
    let body = async_stream(messages);
    let mut r = Response::new(Body::from_stream(body));
    r.headers_mut().insert(header::CONTENT_TYPE, HeaderValue::from_static("application/connect+json"));
    r
}

fn async_stream(
    messages: impl Stream<Item = Result<serde_json::Value, RpcError>> + Send + 'static,
) -> impl Stream<Item = Result<Bytes, std::io::Error>> + Send + 'static {
    let messages = Box::pin(messages);
    futures_util::stream::unfold((messages, false), |(mut m, ended)| async move {
        if ended {
            return None;
        }
        match m.next().await {
            Some(Ok(v)) => Some((Ok(envelope(0, v.to_string().as_bytes())), (m, false))),
            Some(Err(e)) if e.cut => Some((Err(std::io::Error::other(e.message)), (m, true))),
            Some(Err(e)) => {
                let end = serde_json::json!({"error": e.json()});
                Some((Ok(envelope(FLAG_END, end.to_string().as_bytes())), (m, true)))
            }
            None => Some((Ok(envelope(FLAG_END, b"{}")), (m, true))),
        }
    })
}

/// A streaming call refused before any message: an end-of-stream envelope with the error (HTTP 200, as the
/// protocol wants for streams).
pub fn stream_error(e: RpcError) -> Response {
    server_stream(futures_util::stream::iter([Err(e)]))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn envelopes_split_across_reads() {
        let a = envelope(0, br#"{"a":1}"#);
        let b = envelope(FLAG_END, b"{}");
        let mut all = BytesMut::new();
        all.extend_from_slice(&a);
        all.extend_from_slice(&b[..3]);
        let got = take_envelopes(&mut all).unwrap();
        assert_eq!(got, vec![(0, Bytes::from_static(br#"{"a":1}"#))]);
        all.extend_from_slice(&b[3..]);
        let got = take_envelopes(&mut all).unwrap();
        assert_eq!(got, vec![(FLAG_END, Bytes::from_static(b"{}"))]);
        assert!(all.is_empty());
        let mut huge = BytesMut::from(&[0u8, 0xff, 0xff, 0xff, 0xff][..]);
        assert_eq!(take_envelopes(&mut huge).unwrap_err().code, Code::ResourceExhausted);
    }

    #[test]
    fn bad_requests_are_invalid_argument() {
        #[derive(serde::Deserialize, Debug)]
        struct M {
            #[allow(dead_code)]
            path: String,
        }
        assert_eq!(decode_request::<M>(false, b"{\"path\": 3}").unwrap_err().code, Code::InvalidArgument);
        assert_eq!(decode_request::<M>(true, b"").unwrap_err().code, Code::InvalidArgument);
        let ok: M = decode_request(true, &envelope(0, br#"{"path":"/x"}"#)).unwrap();
        assert_eq!(ok.path, "/x");
    }
}
