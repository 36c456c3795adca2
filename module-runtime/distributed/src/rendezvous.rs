//! A TCP rendezvous: rank 0 hands a small byte blob (NCCL's 128-byte unique id) to every other
//! rank, over `std::net` alone.
//!
//! Rank 0 listens ([`RendezvousServer`]); every other rank connects ([`fetch_blob`]) and says
//! which rank it is and what world size it believes in. Rank 0 waits until every rank of
//! `1..world_size` has said so, and only then answers all of them at once: with the blob when
//! every rank agrees, or with the same error for everyone when a rank reported another world
//! size, a rank out of range or twice, or some rank did not come before the deadline. So a
//! mismatch is an error on every rank that took part, and no rank starts a collective (which
//! would wait for the others forever) unless all of them do.
//!
//! The wire format, all integers little-endian:
//! * peer → rank 0: `b"CMRZ"`, a version byte (1), the peer's rank and world size as `u32`;
//! * rank 0 → peer: a status byte (0: the blob follows, 1: an error message follows), a `u32`
//!   length, that many bytes.
//!
//! [`rendezvous_port`] says which port to use under `torchrun`, whose own store already holds
//! `MASTER_PORT`.

use std::io::{Read, Write};
use std::net::{Ipv4Addr, SocketAddr, TcpListener, TcpStream, ToSocketAddrs};
use std::time::{Duration, Instant};

use super::DistributedError;
use crate::Result;

const MAGIC: &[u8; 4] = b"CMRZ";
const VERSION: u8 = 1;
const HELLO_LEN: usize = 13;
/// The largest blob or message sent; an NCCL id is 128 bytes.
const MAX_PAYLOAD: u32 = 1 << 20;
/// How long a rank waits between connection attempts while rank 0 is not listening yet.
const RETRY_PAUSE: Duration = Duration::from_millis(50);

/// The environment variable that sets the rendezvous port explicitly (see [`rendezvous_port`]).
pub const RENDEZVOUS_PORT_VAR: &str = "CANDLE_MODULE_RENDEZVOUS_PORT";

/// The port of the rendezvous for a job whose launcher set `MASTER_PORT=master_port`, reading
/// the other variables through `var`:
///
/// 1. `CANDLE_MODULE_RENDEZVOUS_PORT`, when set, wins (a free port you chose on rank 0's host).
/// 2. Under `torchrun`, which sets `TORCHELASTIC_USE_AGENT_STORE=True`, the elastic agent's
///    own TCP store already listens on `MASTER_PORT`, so the rendezvous takes `MASTER_PORT + 1`.
/// 3. Otherwise (a launcher that only exports the variables, such as a Slurm script), nothing
///    listens on `MASTER_PORT` yet and the rendezvous takes it, as PyTorch's own store would.
///
/// Every rank must see the same variables, so every rank computes the same port.
///
/// ```
/// use module_runtime::distributed::rendezvous_port;
/// let torchrun = [("TORCHELASTIC_USE_AGENT_STORE", "True")];
/// let get = |n: &str| torchrun.iter().find(|v| v.0 == n).map(|v| v.1.to_string());
/// assert_eq!(rendezvous_port(29500, get)?, 29501);
/// assert_eq!(rendezvous_port(29500, |_| None)?, 29500);
/// # Ok::<(), module_runtime::Error>(())
/// ```
pub fn rendezvous_port(master_port: u16, var: impl Fn(&str) -> Option<String>) -> Result<u16> {
    if let Some(port) = var(RENDEZVOUS_PORT_VAR).filter(|v| !v.trim().is_empty()) {
        return port.trim().parse().map_err(|_| {
            DistributedError::Env {
                reason: format!("{RENDEZVOUS_PORT_VAR}={port:?} is not a port number"),
            }
            .into()
        });
    }
    let agent_store = var("TORCHELASTIC_USE_AGENT_STORE")
        .is_some_and(|v| v.trim().eq_ignore_ascii_case("true") || v.trim() == "1");
    if !agent_store {
        return Ok(master_port);
    }
    master_port.checked_add(1).ok_or_else(|| {
        DistributedError::Env {
            reason: format!(
                "MASTER_PORT={master_port} leaves no port above it for the rendezvous (torchrun's \
                 store holds MASTER_PORT): set {RENDEZVOUS_PORT_VAR}"
            ),
        }
        .into()
    })
}

/// Rank 0's side of the rendezvous: a listening socket that hands a blob to every other rank.
///
/// ```
/// use std::time::Duration;
/// use module_runtime::distributed::{fetch_blob, RendezvousServer};
///
/// let server = RendezvousServer::bind("127.0.0.1:0")?; // an ephemeral port
/// let port = server.local_addr().port();
/// let peer = std::thread::spawn(move || fetch_blob("127.0.0.1", port, 1, 2, Duration::from_secs(10)));
/// server.serve(2, b"nccl id", Duration::from_secs(10))?;
/// assert_eq!(peer.join().unwrap()?, b"nccl id");
/// # Ok::<(), module_runtime::Error>(())
/// ```
#[derive(Debug)]
pub struct RendezvousServer {
    listener: TcpListener,
    addr: SocketAddr,
}

impl RendezvousServer {
    /// Listens on `addr` (`"0.0.0.0:29500"`; port 0 picks a free one, see
    /// [`local_addr`](Self::local_addr)).
    pub fn bind(addr: impl ToSocketAddrs + std::fmt::Display) -> Result<RendezvousServer> {
        let shown = addr.to_string();
        let listener =
            TcpListener::bind(addr).map_err(|e| error(&shown, 0, format!("bind: {e}")))?;
        let addr = listener
            .local_addr()
            .map_err(|e| error(&shown, 0, format!("bind: {e}")))?;
        Ok(RendezvousServer { listener, addr })
    }

    /// Listens on every interface at `port` (as torch's TCP store does on the master).
    pub fn bind_port(port: u16) -> Result<RendezvousServer> {
        Self::bind(SocketAddr::from((Ipv4Addr::UNSPECIFIED, port)))
    }

    /// The address it listens on.
    pub fn local_addr(&self) -> SocketAddr {
        self.addr
    }

    /// Waits until ranks `1..world_size` have connected (at most `timeout`), checks that each
    /// came once and reports `world_size`, then sends them `blob`; on any mismatch or a missing
    /// rank, sends every connected rank the error instead and returns it. Consumes the server:
    /// the port is free again afterwards.
    pub fn serve(self, world_size: usize, blob: &[u8], timeout: Duration) -> Result<()> {
        let deadline = Instant::now() + timeout;
        let addr = self.addr.to_string();
        let fail = |cause: String| error(&addr, 0, cause);
        if blob.len() > MAX_PAYLOAD as usize {
            return Err(fail(format!("a blob of {} bytes is too large", blob.len())));
        }
        if world_size <= 1 {
            return Ok(());
        }
        self.listener
            .set_nonblocking(true)
            .map_err(|e| fail(format!("listen: {e}")))?;
        // peers[r] is rank r's connection (rank 0 is this process).
        let mut peers: Vec<Option<TcpStream>> = (0..world_size).map(|_| None).collect();
        // Peers that came with a bad rank: told the error at the end, like the others.
        let mut culprits: Vec<TcpStream> = Vec::new();
        let mut problem: Option<String> = None;
        while problem.is_none() && peers[1..].iter().any(Option::is_none) {
            let (mut stream, from) = match self.listener.accept() {
                Ok(conn) => conn,
                Err(e) if e.kind() == std::io::ErrorKind::WouldBlock => {
                    if Instant::now() >= deadline {
                        let missing: Vec<usize> =
                            (1..world_size).filter(|&r| peers[r].is_none()).collect();
                        problem = Some(format!(
                            "rank(s) {missing:?} did not connect within {timeout:?}"
                        ));
                    } else {
                        std::thread::sleep(Duration::from_millis(5));
                    }
                    continue;
                }
                Err(e) => {
                    problem = Some(format!("accept: {e}"));
                    continue;
                }
            };
            let Ok((rank, world)) = read_hello(&mut stream, deadline) else {
                // Not one of ours (a port scanner, a stale client): ignore it.
                continue;
            };
            if world != world_size {
                problem = Some(format!(
                    "rank {rank} (from {from}) says the world has {world} ranks, rank 0 says \
                     {world_size}: launch every rank with the same WORLD_SIZE"
                ));
            } else if rank == 0 || rank >= world_size {
                problem = Some(format!(
                    "a peer (from {from}) says it is rank {rank}, not one of 1..{world_size}"
                ));
            } else if peers[rank].is_some() {
                problem = Some(format!(
                    "rank {rank} connected twice (the second from {from}): two processes have \
                     the same RANK"
                ));
            }
            // Kept even when it is the culprit, so that it is told too.
            if (1..world_size).contains(&rank) && peers[rank].is_none() {
                peers[rank] = Some(stream);
            } else {
                culprits.push(stream);
            }
        }
        let (status, payload) = match &problem {
            None => (0, blob.to_vec()),
            Some(p) => (1, format!("rank 0: {p}").into_bytes()),
        };
        let mut send_failed = Vec::new();
        for (rank, peer) in peers.iter_mut().enumerate() {
            if let Some(stream) = peer
                && let Err(e) = send(stream, status, &payload)
            {
                send_failed.push(format!("rank {rank}: {e}"));
            }
        }
        for stream in &mut culprits {
            // Best effort: the error is returned here whatever they receive.
            let _ = send(stream, status, &payload);
        }
        match problem {
            Some(p) => Err(fail(p)),
            None if !send_failed.is_empty() => Err(fail(format!(
                "could not send the blob to {}",
                send_failed.join(", ")
            ))),
            None => Ok(()),
        }
    }
}

/// A peer's side: connects to rank 0 at `host:port` (retrying until `timeout`, since rank 0
/// may start later), says it is `rank` of `world_size`, and returns the blob rank 0 sends, or
/// the error rank 0 reports for the whole group.
pub fn fetch_blob(
    host: &str,
    port: u16,
    rank: usize,
    world_size: usize,
    timeout: Duration,
) -> Result<Vec<u8>> {
    let addr = format!("{host}:{port}");
    let fail = |cause: String| error(&addr, rank, cause);
    if rank == 0 || rank >= world_size {
        return Err(fail(format!(
            "rank {rank} cannot fetch from rank 0 in a world of {world_size}"
        )));
    }
    let (rank32, world32) = match (u32::try_from(rank), u32::try_from(world_size)) {
        (Ok(r), Ok(w)) => (r, w),
        _ => {
            return Err(fail(format!(
                "world size {world_size} does not fit in 32 bits"
            )))
        }
    };
    let deadline = Instant::now() + timeout;
    let mut stream = connect(host, port, deadline)
        .map_err(|last| fail(format!("rank 0 did not accept within {timeout:?} ({last})")))?;
    let mut hello = Vec::with_capacity(HELLO_LEN);
    hello.extend_from_slice(MAGIC);
    hello.push(VERSION);
    hello.extend_from_slice(&rank32.to_le_bytes());
    hello.extend_from_slice(&world32.to_le_bytes());
    stream
        .write_all(&hello)
        .map_err(|e| fail(format!("send: {e}")))?;
    let (status, payload) = read_reply(&mut stream, deadline).map_err(|e| {
        fail(if is_timeout(&e) {
            format!("rank 0 did not answer within {timeout:?}")
        } else {
            format!("receive: {e}")
        })
    })?;
    match status {
        0 => Ok(payload),
        _ => Err(fail(String::from_utf8_lossy(&payload).into_owned())),
    }
}

fn error(address: &str, rank: usize, cause: String) -> crate::Error {
    DistributedError::Rendezvous {
        address: address.to_string(),
        rank,
        cause,
    }
    .into()
}

fn is_timeout(e: &std::io::Error) -> bool {
    matches!(
        e.kind(),
        std::io::ErrorKind::WouldBlock | std::io::ErrorKind::TimedOut
    )
}

/// Connects to the first address `host:port` resolves to that accepts, retrying until the
/// deadline; the error is the last attempt's.
fn connect(host: &str, port: u16, deadline: Instant) -> std::result::Result<TcpStream, String> {
    loop {
        let attempt = (host, port)
            .to_socket_addrs()
            .map_err(|e| format!("resolve: {e}"))
            .and_then(|addrs| {
                let mut last = format!("{host} resolves to no address");
                for a in addrs {
                    let left = deadline.saturating_duration_since(Instant::now());
                    let wait = left.clamp(Duration::from_millis(1), Duration::from_secs(1));
                    match TcpStream::connect_timeout(&a, wait) {
                        Ok(s) => return Ok(s),
                        Err(e) => last = format!("connect to {a}: {e}"),
                    }
                }
                Err(last)
            });
        match attempt {
            Ok(s) => return Ok(s),
            Err(last) if Instant::now() + RETRY_PAUSE >= deadline => return Err(last),
            Err(_) => std::thread::sleep(RETRY_PAUSE),
        }
    }
}

/// Reads exactly `buf.len()` bytes, giving up at the deadline.
fn read_until(stream: &mut TcpStream, buf: &mut [u8], deadline: Instant) -> std::io::Result<()> {
    let left = deadline.saturating_duration_since(Instant::now());
    if left.is_zero() {
        return Err(std::io::ErrorKind::TimedOut.into());
    }
    stream.set_nonblocking(false)?;
    stream.set_read_timeout(Some(left))?;
    stream.read_exact(buf)
}

fn read_hello(stream: &mut TcpStream, deadline: Instant) -> std::io::Result<(usize, usize)> {
    let mut hello = [0u8; HELLO_LEN];
    read_until(stream, &mut hello, deadline)?;
    if &hello[..4] != MAGIC || hello[4] != VERSION {
        return Err(std::io::ErrorKind::InvalidData.into());
    }
    let word = |i: usize| u32::from_le_bytes(hello[i..i + 4].try_into().expect("4 bytes")) as usize;
    Ok((word(5), word(9)))
}

fn read_reply(stream: &mut TcpStream, deadline: Instant) -> std::io::Result<(u8, Vec<u8>)> {
    let mut head = [0u8; 5];
    read_until(stream, &mut head, deadline)?;
    let len = u32::from_le_bytes(head[1..].try_into().expect("4 bytes"));
    if len > MAX_PAYLOAD {
        return Err(std::io::Error::new(
            std::io::ErrorKind::InvalidData,
            format!("a reply of {len} bytes"),
        ));
    }
    let mut payload = vec![0u8; len as usize];
    read_until(stream, &mut payload, deadline)?;
    Ok((head[0], payload))
}

fn send(stream: &mut TcpStream, status: u8, payload: &[u8]) -> std::io::Result<()> {
    let len = u32::try_from(payload.len()).expect("payloads are capped at MAX_PAYLOAD");
    let mut msg = Vec::with_capacity(5 + payload.len());
    msg.push(status);
    msg.extend_from_slice(&len.to_le_bytes());
    msg.extend_from_slice(payload);
    stream.set_nonblocking(false)?;
    stream.set_write_timeout(Some(Duration::from_secs(10)))?;
    stream.write_all(&msg)?;
    stream.flush()
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::Error;

    const LONG: Duration = Duration::from_secs(20);

    fn server() -> (RendezvousServer, u16) {
        let server = RendezvousServer::bind("127.0.0.1:0").unwrap();
        let port = server.local_addr().port();
        (server, port)
    }

    fn cause(result: Result<impl std::fmt::Debug>) -> (usize, String) {
        match result {
            Err(Error::Distributed(DistributedError::Rendezvous { rank, cause, .. })) => {
                (rank, cause)
            }
            other => panic!("expected a rendezvous error, got {other:?}"),
        }
    }

    #[test]
    fn every_rank_receives_the_blob() {
        let (server, port) = server();
        let blob: Vec<u8> = (0..128u8).collect();
        let peers: Vec<_> = (1..3)
            .map(|rank| std::thread::spawn(move || fetch_blob("127.0.0.1", port, rank, 3, LONG)))
            .collect();
        server.serve(3, &blob, LONG).unwrap();
        for peer in peers {
            assert_eq!(peer.join().unwrap().unwrap(), blob);
        }
    }

    #[test]
    fn peers_may_start_before_rank_0() {
        // Reserve a free port, release it, and start the peer before anyone listens.
        let port = server().1;
        let peer = std::thread::spawn(move || fetch_blob("127.0.0.1", port, 1, 2, LONG));
        std::thread::sleep(Duration::from_millis(200));
        let server = RendezvousServer::bind(format!("127.0.0.1:{port}")).unwrap();
        server.serve(2, b"id", LONG).unwrap();
        assert_eq!(peer.join().unwrap().unwrap(), b"id");
    }

    #[test]
    fn a_wrong_world_size_is_an_error_on_every_rank() {
        let (server, port) = server();
        let short = Duration::from_secs(2);
        let good = std::thread::spawn(move || fetch_blob("127.0.0.1", port, 1, 3, short));
        let bad = std::thread::spawn(move || fetch_blob("127.0.0.1", port, 2, 4, LONG));
        let (rank, msg) = cause(server.serve(3, b"id", LONG));
        assert_eq!(rank, 0);
        assert!(msg.contains("rank 2") && msg.contains("4 ranks"), "{msg}");
        let (rank, msg) = cause(bad.join().unwrap());
        assert_eq!(rank, 2);
        assert!(msg.contains("4 ranks"), "{msg}");
        // The rank that agreed learns of the mismatch too (or, if it came after rank 0 gave up,
        // fails to connect): it never gets the blob.
        assert_eq!(cause(good.join().unwrap()).0, 1);
    }

    #[test]
    fn a_duplicate_rank_is_an_error() {
        let (server, port) = server();
        let peers: Vec<_> = (0..2)
            .map(|_| std::thread::spawn(move || fetch_blob("127.0.0.1", port, 1, 3, LONG)))
            .collect();
        let (_, msg) = cause(server.serve(3, b"id", LONG));
        assert!(msg.contains("rank 1 connected twice"), "{msg}");
        for peer in peers {
            assert!(cause(peer.join().unwrap()).1.contains("twice"));
        }
    }

    #[test]
    fn a_rank_that_never_comes_times_out_on_every_rank() {
        let (server, port) = server();
        let present = std::thread::spawn(move || fetch_blob("127.0.0.1", port, 1, 3, LONG));
        let (_, msg) = cause(server.serve(3, b"id", Duration::from_millis(500)));
        assert!(msg.contains("rank(s) [2] did not connect"), "{msg}");
        // Told by rank 0, long before its own deadline.
        let (rank, msg) = cause(present.join().unwrap());
        assert_eq!(rank, 1);
        assert!(msg.contains("[2] did not connect"), "{msg}");
    }

    #[test]
    fn no_rank_0_is_a_timeout_naming_the_address() {
        let port = server().1; // nobody listens there any more
        let err = fetch_blob("127.0.0.1", port, 1, 2, Duration::from_millis(300)).unwrap_err();
        let text = err.to_string();
        assert!(text.contains(&format!("127.0.0.1:{port}")), "{text}");
        assert!(
            text.contains("rank 1") && text.contains("did not accept"),
            "{text}"
        );
    }

    #[test]
    fn a_peer_rank_out_of_range_is_refused_before_connecting() {
        let (rank, msg) = cause(fetch_blob("127.0.0.1", 1, 2, 2, LONG));
        assert_eq!(rank, 2);
        assert!(msg.contains("world of 2"), "{msg}");
    }

    #[test]
    fn a_world_of_one_needs_no_peer() {
        server().0.serve(1, b"id", Duration::ZERO).unwrap();
    }

    #[test]
    fn the_port_rule() {
        let vars = |pairs: &'static [(&'static str, &'static str)]| {
            move |n: &str| pairs.iter().find(|v| v.0 == n).map(|v| v.1.to_string())
        };
        assert_eq!(rendezvous_port(29500, vars(&[])).unwrap(), 29500);
        let agent = vars(&[("TORCHELASTIC_USE_AGENT_STORE", "True")]);
        assert_eq!(rendezvous_port(29500, agent).unwrap(), 29501);
        let chosen = vars(&[
            ("TORCHELASTIC_USE_AGENT_STORE", "True"),
            (RENDEZVOUS_PORT_VAR, "31000"),
        ]);
        assert_eq!(rendezvous_port(29500, chosen).unwrap(), 31000);
        assert!(rendezvous_port(65535, agent).is_err());
        assert!(rendezvous_port(1, vars(&[(RENDEZVOUS_PORT_VAR, "x")])).is_err());
    }
}
