//! The metrics endpoint of a machine process: `GET /metrics` over HTTP/1.1 answers the
//! machine's Prometheus metrics (`farm::node::Node::metrics`, the OpenMetrics text format),
//! one request per connection. Small on purpose: one path, no keep-alive, requests of a few
//! hundred bytes; what Prometheus and `curl` send.

use std::io::{Read, Write};
use std::net::{SocketAddr, TcpListener, TcpStream};
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::Duration;

use farm::node::Node;

/// How long a connection may take to send its request, or to take the answer.
const IO_TIMEOUT: Duration = Duration::from_secs(2);

/// The longest request read.
const REQUEST_MAX: usize = 8 << 10;

/// Answers scrapes on `listener` (non-blocking) from `node` until `stop`.
pub(crate) fn serve(listener: &TcpListener, node: &Node, stop: &AtomicBool) {
    while !stop.load(Ordering::Relaxed) {
        match listener.accept() {
            Ok((conn, _)) => {
                if let Err(e) = answer(conn, node) {
                    tracing::debug!(error = %e, "a metrics request failed");
                }
            }
            Err(e) if e.kind() == std::io::ErrorKind::WouldBlock => {
                std::thread::sleep(Duration::from_millis(20));
            }
            Err(e) => {
                tracing::warn!(error = %e, "accepting a metrics connection");
                std::thread::sleep(Duration::from_millis(20));
            }
        }
    }
}

fn answer(mut conn: TcpStream, node: &Node) -> std::io::Result<()> {
    conn.set_nonblocking(false)?;
    conn.set_read_timeout(Some(IO_TIMEOUT))?;
    conn.set_write_timeout(Some(IO_TIMEOUT))?;
    let mut request = Vec::new();
    let mut buf = [0u8; 1024];
    while !request.windows(4).any(|w| w == b"\r\n\r\n") && request.len() < REQUEST_MAX {
        let n = conn.read(&mut buf)?;
        if n == 0 {
            break;
        }
        request.extend_from_slice(&buf[..n]);
    }
    let line = request.split(|&b| b == b'\r').next().unwrap_or_default();
    let mut words = line.split(|&b| b == b' ');
    let (method, path) = (words.next(), words.next());
    let (status, kind, body) = match (method, path) {
        (Some(b"GET"), Some(b"/metrics")) => (
            "200 OK",
            "application/openmetrics-text; version=1.0.0; charset=utf-8",
            node.metrics(),
        ),
        (Some(b"GET"), _) => ("404 Not Found", "text/plain", "try /metrics\n".into()),
        _ => (
            "405 Method Not Allowed",
            "text/plain",
            "GET /metrics\n".into(),
        ),
    };
    write!(
        conn,
        "HTTP/1.1 {status}\r\nContent-Type: {kind}\r\nContent-Length: {}\r\nConnection: close\r\n\r\n{body}",
        body.len()
    )?;
    conn.flush()
}

/// The metrics a machine serves at `addr` (`GET /metrics`), the body of the answer.
pub fn scrape(addr: SocketAddr) -> std::io::Result<String> {
    let mut conn = TcpStream::connect_timeout(&addr, IO_TIMEOUT)?;
    conn.set_read_timeout(Some(IO_TIMEOUT))?;
    write!(
        conn,
        "GET /metrics HTTP/1.1\r\nHost: {addr}\r\nConnection: close\r\n\r\n"
    )?;
    let mut answer = String::new();
    conn.read_to_string(&mut answer)?;
    let (head, body) = answer.split_once("\r\n\r\n").ok_or_else(|| {
        std::io::Error::new(std::io::ErrorKind::InvalidData, "an answer without a body")
    })?;
    if !head.starts_with("HTTP/1.1 200") {
        let status = head.lines().next().unwrap_or_default();
        return Err(std::io::Error::other(format!("answered {status}")));
    }
    Ok(body.to_string())
}
