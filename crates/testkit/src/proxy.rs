//! A TCP fault proxy for tests: a test points a store, key store, broker or destination URL at
//! [`FaultProxy::addr`] instead of the service, and cuts the service off at the moment it
//! chooses, in one of the ways Toxiproxy names:
//!
//! - `down` (every open connection closed, new ones closed as soon as they are accepted);
//! - `reset_peer` (the same with a TCP reset instead of a close: the client reads "connection
//!   reset by peer");
//! - `timeout`: connections stay open and nothing gets through either way (a server that stopped
//!   answering, or a network that drops packets), for ever ([`FaultProxy::stall`]) or until a
//!   limit, after which they are closed ([`FaultProxy::timeout`]);
//! - `latency` (every chunk held back a while, both ways, the connections otherwise working);
//! - `slicer` (every chunk passed on in slices of a few bytes, a pause after each: a slow link
//!   that still delivers everything);
//! - `bandwidth` (at most so many bytes a second each way);
//! - `limit_data` (a connection closed once so many bytes have passed one way: the cut that
//!   lands inside a statement, a commit's answer or a response's head, wherever the test puts
//!   it);
//! - `slow_close` (a close passed on only after a delay).

use std::net::SocketAddr;
use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::Duration;

use tokio::io::{AsyncRead, AsyncReadExt, AsyncWrite, AsyncWriteExt};
use tokio::net::{TcpListener, TcpStream};
use tokio::sync::watch;
use tokio::task::JoinHandle;

/// What the proxy does with connections.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Mode {
    Up,
    Down,
    Reset,
    /// Nothing passes; each connection is closed after the limit, if any, from the moment it
    /// stalled (or was accepted).
    Stall(Option<Duration>),
}

/// One way through the proxy, in Toxiproxy's words.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Direction {
    /// From the client (the gateway) to the service.
    Upstream,
    /// From the service back to the client.
    Downstream,
}

/// A forwarder from a loopback port to `upstream`, with a switch.
pub struct FaultProxy {
    addr: SocketAddr,
    mode: watch::Sender<Mode>,
    accepted: Arc<AtomicUsize>,
    toxics: Arc<Toxics>,
    task: JoinHandle<()>,
}

/// How forwarded bytes are slowed down, set while connections are open.
#[derive(Debug, Default)]
struct Toxics {
    /// Microseconds each forwarded chunk waits.
    latency_us: AtomicU64,
    /// Bytes per slice (0: chunks are passed on whole).
    slice_bytes: AtomicUsize,
    /// Microseconds after each slice.
    slice_pause_us: AtomicU64,
    /// Bytes a second each way (0: no limit).
    bandwidth: AtomicU64,
    /// Microseconds a close waits before it is passed on.
    slow_close_us: AtomicU64,
    /// Bytes a new connection passes upstream, then downstream, before it is closed, plus one
    /// (0: no limit); read as each connection is accepted.
    limit_up: AtomicU64,
    limit_down: AtomicU64,
    /// Bytes passed on upstream, then downstream, on every connection since the counts were
    /// last reset.
    passed_up: AtomicU64,
    passed_down: AtomicU64,
    /// The most bytes one connection has passed on upstream, then downstream, in that time.
    most_up: AtomicU64,
    most_down: AtomicU64,
    /// How many times open connections were told to close (`down`, `reset_peer`, a stall,
    /// [`FaultProxy::close_open`]): a connection that sees this move since it was accepted
    /// closes, even when the mode it reads is `Up` again (the mode's channel keeps only the
    /// latest value, so `down` then `up` at once would otherwise close nothing).
    cuts: AtomicU64,
}

/// The byte limits one connection took when it was accepted (`None`: no limit).
#[derive(Debug, Clone, Copy)]
struct Limits {
    up: Option<u64>,
    down: Option<u64>,
}

impl Toxics {
    fn limits(&self) -> Limits {
        let limit = |v: &AtomicU64| v.load(Ordering::SeqCst).checked_sub(1);
        Limits {
            up: limit(&self.limit_up),
            down: limit(&self.limit_down),
        }
    }
}

impl FaultProxy {
    /// Listens on a free loopback port and forwards every connection to `upstream`.
    pub async fn start(upstream: SocketAddr) -> std::io::Result<FaultProxy> {
        let listener = TcpListener::bind("127.0.0.1:0").await?;
        let addr = listener.local_addr()?;
        let (mode, watching) = watch::channel(Mode::Up);
        let accepted = Arc::new(AtomicUsize::new(0));
        let toxics = Arc::new(Toxics::default());
        let (count, shaping) = (accepted.clone(), toxics.clone());
        let task = tokio::spawn(async move {
            while let Ok((client, _)) = listener.accept().await {
                count.fetch_add(1, Ordering::SeqCst);
                let mut cut = watching.clone();
                let mode = *cut.borrow_and_update();
                match mode {
                    Mode::Down => drop(client),
                    Mode::Reset => reset(client),
                    // Held open, never forwarded; closed once the proxy is up again or the
                    // stall's limit has passed.
                    Mode::Stall(limit) => {
                        tokio::spawn(async move {
                            let _held = client;
                            stalled(&mut cut, limit).await;
                        });
                    }
                    Mode::Up => {
                        let shaping = shaping.clone();
                        let limits = shaping.limits();
                        let cuts = shaping.cuts.load(Ordering::SeqCst);
                        tokio::spawn(async move {
                            let Ok(server) = TcpStream::connect(upstream).await else {
                                return;
                            };
                            forward(client, server, &mut cut, &shaping, limits, cuts).await;
                        });
                    }
                }
            }
        });
        Ok(FaultProxy {
            addr,
            mode,
            accepted,
            toxics,
            task,
        })
    }

    /// Where to connect instead of the service.
    pub fn addr(&self) -> SocketAddr {
        self.addr
    }

    /// Cuts the service off: open connections are closed, new ones closed on arrival.
    pub fn down(&self) {
        self.cut(Mode::Down);
    }

    /// Closes every open connection and lets new ones through: what `down` then `up` do.
    pub fn close_open(&self) {
        self.cut(Mode::Up);
    }

    /// Sets `mode` after marking every open connection to be closed.
    fn cut(&self, mode: Mode) {
        self.toxics.cuts.fetch_add(1, Ordering::SeqCst);
        self.mode.send_replace(mode);
    }

    /// Cuts the service off with a TCP reset: open connections and new ones are aborted, and
    /// the client reads "connection reset by peer" rather than an end of stream.
    pub fn reset_peer(&self) {
        self.cut(Mode::Reset);
    }

    /// Stops every byte, both ways, on open connections and new ones, which stay open: the
    /// other side hears nothing, not even a close, until [`FaultProxy::up`] closes them.
    pub fn stall(&self) {
        self.cut(Mode::Stall(None));
    }

    /// Toxiproxy's `timeout` with a limit: stops every byte, both ways, on open connections
    /// and new ones, and closes each connection once it has been stalled for `after` (an open
    /// one counting from this call, a new one from its arrival), until [`FaultProxy::up`].
    pub fn timeout(&self, after: Duration) {
        self.cut(Mode::Stall(Some(after)));
    }

    /// Lets connections through again (the ones closed, reset or stalled are closed).
    pub fn up(&self) {
        self.mode.send_replace(Mode::Up);
    }

    /// Holds every chunk read from either side for `delay` before passing it on, on open
    /// connections and new ones; `Duration::ZERO` ends it.
    pub fn set_latency(&self, delay: Duration) {
        self.toxics
            .latency_us
            .store(micros(delay), Ordering::SeqCst);
    }

    /// Passes every chunk on in slices of `bytes`, pausing `pause` after each, both ways, on
    /// open connections and new ones; `bytes` 0 ends it. Bytes already read are still passed
    /// on when the other side goes away, as a slow network delivers what it holds.
    pub fn set_slicer(&self, bytes: usize, pause: Duration) {
        self.toxics
            .slice_pause_us
            .store(micros(pause), Ordering::SeqCst);
        self.toxics.slice_bytes.store(bytes, Ordering::SeqCst);
    }

    /// Passes at most `bytes_per_second` each way on every connection, open or new, in pieces
    /// of a fiftieth of it; 0 ends it.
    pub fn set_bandwidth(&self, bytes_per_second: u64) {
        self.toxics
            .bandwidth
            .store(bytes_per_second, Ordering::SeqCst);
    }

    /// Closes each connection accepted from now on once `bytes` have passed `direction` on it
    /// (the bytes up to the limit are passed on, then both sides are closed); `None` ends it
    /// for new connections. Connections open before keep the limit they were accepted with,
    /// so a test that wants every connection cut at the same point closes the open ones
    /// ([`FaultProxy::close_open`]) after setting it.
    pub fn set_limit_data(&self, direction: Direction, bytes: Option<u64>) {
        let limit = match direction {
            Direction::Upstream => &self.toxics.limit_up,
            Direction::Downstream => &self.toxics.limit_down,
        };
        // Stored one up, so that 0 can mean "no limit" and a limit of 0 bytes still cuts.
        limit.store(bytes.map_or(0, |b| b.saturating_add(1)), Ordering::SeqCst);
    }

    /// Holds every close (one side's end of stream, or the connection's cut by a data limit)
    /// for `delay` before passing it on; `Duration::ZERO` ends it.
    pub fn set_slow_close(&self, delay: Duration) {
        self.toxics
            .slow_close_us
            .store(micros(delay), Ordering::SeqCst);
    }

    /// How many bytes the proxy has passed on `direction`, over every connection, since
    /// [`FaultProxy::reset_counts`].
    pub fn passed(&self, direction: Direction) -> u64 {
        match direction {
            Direction::Upstream => self.toxics.passed_up.load(Ordering::SeqCst),
            Direction::Downstream => self.toxics.passed_down.load(Ordering::SeqCst),
        }
    }

    /// The most bytes one connection has passed on `direction` since
    /// [`FaultProxy::reset_counts`] (counting from its start, whenever that was): what a test
    /// measures of a conversation before it sweeps a data limit across it.
    pub fn most_on_one(&self, direction: Direction) -> u64 {
        match direction {
            Direction::Upstream => self.toxics.most_up.load(Ordering::SeqCst),
            Direction::Downstream => self.toxics.most_down.load(Ordering::SeqCst),
        }
    }

    /// Starts [`FaultProxy::passed`] and [`FaultProxy::most_on_one`] again from zero.
    pub fn reset_counts(&self) {
        for count in [
            &self.toxics.passed_up,
            &self.toxics.passed_down,
            &self.toxics.most_up,
            &self.toxics.most_down,
        ] {
            count.store(0, Ordering::SeqCst);
        }
    }

    /// How many connections the proxy has accepted, cut ones included.
    pub fn accepted(&self) -> usize {
        self.accepted.load(Ordering::SeqCst)
    }
}

impl Drop for FaultProxy {
    fn drop(&mut self) {
        self.task.abort();
        self.mode.send_replace(Mode::Down);
    }
}

fn micros(d: Duration) -> u64 {
    u64::try_from(d.as_micros()).unwrap_or(u64::MAX)
}

/// Aborts a connection: a TCP reset, not a close.
fn reset(stream: TcpStream) {
    let _ = stream.set_zero_linger();
    drop(stream);
}

/// Waits while the proxy stalls: until it is up (or down) again, or until `limit` has passed.
async fn stalled(cut: &mut watch::Receiver<Mode>, limit: Option<Duration>) {
    let over = async {
        match limit {
            Some(limit) => tokio::time::sleep(limit).await,
            None => std::future::pending().await,
        }
    };
    tokio::select! {
        _ = cut.wait_for(|m| !matches!(m, Mode::Stall(_))) => {}
        _ = over => {}
    }
}

/// Copies both ways until both sides have closed, either fails, a data limit is reached or
/// the proxy is cut (`cuts` moved on from the count when the connection was accepted); while it stalls, copies nothing and keeps both ends open until it is up
/// again or the stall's limit has passed, then closes them.
async fn forward(
    mut client: TcpStream,
    mut server: TcpStream,
    cut: &mut watch::Receiver<Mode>,
    toxics: &Toxics,
    limits: Limits,
    cuts: u64,
) {
    let ended = {
        let (client_read, client_write) = client.split();
        let (server_read, server_write) = server.split();
        let copy = async {
            tokio::try_join!(
                pipe(
                    client_read,
                    server_write,
                    toxics,
                    limits.up,
                    Direction::Upstream
                ),
                pipe(
                    server_read,
                    client_write,
                    toxics,
                    limits.down,
                    Direction::Downstream
                )
            )
        };
        tokio::pin!(copy);
        loop {
            tokio::select! {
                _ = &mut copy => break Mode::Up,
                changed = cut.changed() => {
                    let mode = *cut.borrow_and_update();
                    match (changed, mode) {
                        (Err(_), _) => break Mode::Down,
                        (Ok(()), Mode::Up) if toxics.cuts.load(Ordering::SeqCst) == cuts => {}
                        (Ok(()), Mode::Up) => break Mode::Down,
                        (Ok(()), Mode::Down | Mode::Reset) => break mode,
                        (Ok(()), Mode::Stall(limit)) => {
                            stalled(cut, limit).await;
                            break Mode::Down;
                        }
                    }
                }
            }
        }
    };
    if ended == Mode::Reset {
        reset(client);
    }
}

/// Copies one way, each chunk after the proxy's latency, in its slices and at its bandwidth,
/// until `limit` bytes have passed (then fails, which closes both sides), counting them as
/// passed on `direction`; passes the end of stream on. A close waits the proxy's `slow_close`
/// first.
async fn pipe(
    mut from: impl AsyncRead + Unpin,
    mut to: impl AsyncWrite + Unpin,
    toxics: &Toxics,
    limit: Option<u64>,
    direction: Direction,
) -> std::io::Result<()> {
    let (passed, most) = match direction {
        Direction::Upstream => (&toxics.passed_up, &toxics.most_up),
        Direction::Downstream => (&toxics.passed_down, &toxics.most_down),
    };
    let mut buf = vec![0u8; 16 * 1024];
    let mut left = limit;
    let mut on_this_one = 0u64;
    loop {
        if left == Some(0) {
            slow_close(toxics).await;
            return Err(std::io::Error::other("the proxy's data limit was reached"));
        }
        let n = from.read(&mut buf).await?;
        if n == 0 {
            slow_close(toxics).await;
            return to.shutdown().await;
        }
        let delay = toxics.latency_us.load(Ordering::SeqCst);
        if delay > 0 {
            tokio::time::sleep(Duration::from_micros(delay)).await;
        }
        let n = match left {
            Some(l) => {
                let n = n.min(usize::try_from(l).unwrap_or(usize::MAX));
                left = Some(l - n as u64);
                n
            }
            None => n,
        };
        shaped(&mut to, &buf[..n], toxics).await?;
        passed.fetch_add(n as u64, Ordering::SeqCst);
        on_this_one += n as u64;
        most.fetch_max(on_this_one, Ordering::SeqCst);
    }
}

/// Writes `bytes` in the proxy's slices and at its bandwidth, or whole when neither is set.
async fn shaped(
    to: &mut (impl AsyncWrite + Unpin),
    bytes: &[u8],
    toxics: &Toxics,
) -> std::io::Result<()> {
    let slice = toxics.slice_bytes.load(Ordering::SeqCst);
    let rate = toxics.bandwidth.load(Ordering::SeqCst);
    if slice == 0 && rate == 0 {
        return to.write_all(bytes).await;
    }
    // At a limited rate, pieces of a fiftieth of a second's bytes keep the pace even.
    let paced = usize::try_from(rate / 50).unwrap_or(usize::MAX).max(1);
    let piece = match (slice, rate) {
        (0, _) => paced,
        (slice, 0) => slice,
        (slice, _) => slice.min(paced),
    };
    let pause = if slice > 0 {
        Duration::from_micros(toxics.slice_pause_us.load(Ordering::SeqCst))
    } else {
        Duration::ZERO
    };
    for piece in bytes.chunks(piece) {
        to.write_all(piece).await?;
        to.flush().await?;
        let mut wait = pause;
        if let Some(us) = (piece.len() as u64 * 1_000_000).checked_div(rate) {
            wait += Duration::from_micros(us);
        }
        if !wait.is_zero() {
            tokio::time::sleep(wait).await;
        }
    }
    Ok(())
}

/// Waits the proxy's `slow_close` delay, if any.
async fn slow_close(toxics: &Toxics) {
    let delay = toxics.slow_close_us.load(Ordering::SeqCst);
    if delay > 0 {
        tokio::time::sleep(Duration::from_micros(delay)).await;
    }
}

#[cfg(test)]
mod tests {
    use tokio::io::{AsyncReadExt, AsyncWriteExt};

    use super::*;

    /// An echo server on a free loopback port.
    async fn echo_server() -> SocketAddr {
        let upstream = TcpListener::bind("127.0.0.1:0").await.unwrap();
        let upstream_addr = upstream.local_addr().unwrap();
        tokio::spawn(async move {
            while let Ok((mut s, _)) = upstream.accept().await {
                tokio::spawn(async move {
                    let mut buf = [0u8; 64];
                    while let Ok(n) = s.read(&mut buf).await {
                        if n == 0 || s.write_all(&buf[..n]).await.is_err() {
                            return;
                        }
                    }
                });
            }
        });
        upstream_addr
    }

    /// Sends `ping` and reads it back.
    async fn echo(mut s: TcpStream) -> std::io::Result<(TcpStream, [u8; 4])> {
        s.write_all(b"ping").await?;
        let mut buf = [0u8; 4];
        s.read_exact(&mut buf).await?;
        Ok((s, buf))
    }

    #[tokio::test]
    async fn resets_open_and_new_connections_then_forwards_again() {
        let proxy = FaultProxy::start(echo_server().await).await.unwrap();
        let (mut open, buf) = echo(TcpStream::connect(proxy.addr()).await.unwrap())
            .await
            .unwrap();
        assert_eq!(&buf, b"ping");

        proxy.reset_peer();
        let mut rest = Vec::new();
        let err = open.read_to_end(&mut rest).await.unwrap_err();
        assert_eq!(err.kind(), std::io::ErrorKind::ConnectionReset, "{err}");
        let mut fresh = TcpStream::connect(proxy.addr()).await.unwrap();
        let err = fresh.read_to_end(&mut rest).await.unwrap_err();
        assert_eq!(err.kind(), std::io::ErrorKind::ConnectionReset, "{err}");

        proxy.up();
        let (_, buf) = echo(TcpStream::connect(proxy.addr()).await.unwrap())
            .await
            .unwrap();
        assert_eq!(&buf, b"ping");
    }

    #[tokio::test]
    async fn holds_each_chunk_back_by_its_latency() {
        let proxy = FaultProxy::start(echo_server().await).await.unwrap();
        let (open, _) = echo(TcpStream::connect(proxy.addr()).await.unwrap())
            .await
            .unwrap();
        proxy.set_latency(Duration::from_millis(150));
        // Two chunks each way: the round trip waits at least twice the latency.
        let started = std::time::Instant::now();
        let (open, buf) = echo(open).await.unwrap();
        assert_eq!(&buf, b"ping");
        assert!(
            started.elapsed() >= Duration::from_millis(300),
            "{:?}",
            started.elapsed()
        );
        proxy.set_latency(Duration::ZERO);
        let (_, buf) = echo(open).await.unwrap();
        assert_eq!(&buf, b"ping", "the same connection, through");
    }

    #[tokio::test]
    async fn a_slicer_passes_every_byte_on_in_slices_with_a_pause_after_each() {
        let proxy = FaultProxy::start(echo_server().await).await.unwrap();
        proxy.set_slicer(1, Duration::from_millis(50));
        // "ping" goes out as four slices, three pauses between them before the last byte can
        // reach the echo server (which answers byte by byte as it reads).
        let started = std::time::Instant::now();
        let (open, buf) = echo(TcpStream::connect(proxy.addr()).await.unwrap())
            .await
            .unwrap();
        assert_eq!(&buf, b"ping");
        assert!(
            started.elapsed() >= Duration::from_millis(150),
            "{:?}",
            started.elapsed()
        );
        proxy.set_slicer(0, Duration::ZERO);
        let (_, buf) = echo(open).await.unwrap();
        assert_eq!(&buf, b"ping", "the same connection, whole again");
    }

    /// Reads until the end of stream or an error; what came, and whether it ended cleanly.
    async fn read_all(s: &mut TcpStream) -> (Vec<u8>, bool) {
        let mut got = Vec::new();
        let clean = s.read_to_end(&mut got).await.is_ok();
        (got, clean)
    }

    #[tokio::test]
    async fn counts_the_bytes_it_passes_each_way() {
        let proxy = FaultProxy::start(echo_server().await).await.unwrap();
        let (s, _) = echo(TcpStream::connect(proxy.addr()).await.unwrap())
            .await
            .unwrap();
        let _ = echo(s).await.unwrap();
        let (other, _) = echo(TcpStream::connect(proxy.addr()).await.unwrap())
            .await
            .unwrap();
        assert_eq!(proxy.passed(Direction::Upstream), 12);
        assert_eq!(proxy.passed(Direction::Downstream), 12);
        assert_eq!(proxy.most_on_one(Direction::Upstream), 8);
        assert_eq!(proxy.most_on_one(Direction::Downstream), 8);
        proxy.reset_counts();
        let _ = echo(other).await.unwrap();
        assert_eq!(proxy.passed(Direction::Downstream), 4);
        assert_eq!(
            proxy.most_on_one(Direction::Downstream),
            8,
            "that connection's whole count"
        );
    }

    #[tokio::test]
    async fn a_data_limit_passes_its_bytes_then_closes_new_connections_only() {
        let proxy = FaultProxy::start(echo_server().await).await.unwrap();
        let (open, _) = echo(TcpStream::connect(proxy.addr()).await.unwrap())
            .await
            .unwrap();

        // Upstream: 6 bytes reach the echo server, which sends them back; then both sides
        // are closed.
        proxy.set_limit_data(Direction::Upstream, Some(6));
        let mut cut = TcpStream::connect(proxy.addr()).await.unwrap();
        cut.write_all(b"pingpong").await.unwrap();
        let (got, _) = read_all(&mut cut).await;
        assert!(b"pingpo".starts_with(&got), "{got:?}");
        assert!(got.len() <= 6, "{got:?}");
        let (open, buf) = echo(open).await.unwrap();
        assert_eq!(
            &buf, b"ping",
            "an open connection keeps the limit it had: none"
        );

        // Downstream: the answer is cut after 3 bytes, exactly.
        proxy.set_limit_data(Direction::Upstream, None);
        proxy.set_limit_data(Direction::Downstream, Some(3));
        let mut cut = TcpStream::connect(proxy.addr()).await.unwrap();
        cut.write_all(b"ping").await.unwrap();
        let (got, _) = read_all(&mut cut).await;
        assert_eq!(got, b"pin");

        // A limit of 0 bytes: closed before anything passes.
        proxy.set_limit_data(Direction::Downstream, Some(0));
        let mut cut = TcpStream::connect(proxy.addr()).await.unwrap();
        let _ = cut.write_all(b"ping").await;
        let (got, _) = read_all(&mut cut).await;
        assert!(got.is_empty(), "{got:?}");

        proxy.set_limit_data(Direction::Downstream, None);
        let (_, buf) = echo(TcpStream::connect(proxy.addr()).await.unwrap())
            .await
            .unwrap();
        assert_eq!(&buf, b"ping", "no limit again");
        let (_, buf) = echo(open).await.unwrap();
        assert_eq!(&buf, b"ping");
    }

    #[tokio::test]
    async fn down_then_up_at_once_still_closes_what_was_open() {
        let proxy = FaultProxy::start(echo_server().await).await.unwrap();
        let (mut first, _) = echo(TcpStream::connect(proxy.addr()).await.unwrap())
            .await
            .unwrap();
        proxy.down();
        proxy.up();
        let (got, _) = read_all(&mut first).await;
        assert!(got.is_empty(), "{got:?}");
        let (mut second, _) = echo(TcpStream::connect(proxy.addr()).await.unwrap())
            .await
            .unwrap();
        proxy.close_open();
        let (got, _) = read_all(&mut second).await;
        assert!(got.is_empty(), "{got:?}");
        let (_, buf) = echo(TcpStream::connect(proxy.addr()).await.unwrap())
            .await
            .unwrap();
        assert_eq!(&buf, b"ping", "new connections go through");
    }

    #[tokio::test]
    async fn a_bandwidth_limit_paces_every_byte_through() {
        let proxy = FaultProxy::start(echo_server().await).await.unwrap();
        proxy.set_bandwidth(2_000);
        // 400 bytes at 2,000 B/s go in ten pieces of 40 with 20 ms after each: the last one
        // leaves at least 0.18 s after the first (the echo comes back alongside).
        let payload = vec![b'x'; 400];
        let mut s = TcpStream::connect(proxy.addr()).await.unwrap();
        let started = std::time::Instant::now();
        s.write_all(&payload).await.unwrap();
        let mut back = vec![0u8; payload.len()];
        s.read_exact(&mut back).await.unwrap();
        assert_eq!(back, payload);
        assert!(
            started.elapsed() >= Duration::from_millis(180),
            "{:?}",
            started.elapsed()
        );
        proxy.set_bandwidth(0);
        let (_, buf) = echo(s).await.unwrap();
        assert_eq!(&buf, b"ping", "the same connection, unlimited again");
    }

    #[tokio::test]
    async fn a_slow_close_holds_the_end_of_stream_back() {
        let proxy = FaultProxy::start(echo_server().await).await.unwrap();
        proxy.set_slow_close(Duration::from_millis(300));
        let (mut s, buf) = echo(TcpStream::connect(proxy.addr()).await.unwrap())
            .await
            .unwrap();
        assert_eq!(&buf, b"ping");
        // Our end of stream reaches the echo server 0.3 s late, and its close comes back
        // 0.3 s after that.
        let started = std::time::Instant::now();
        s.shutdown().await.unwrap();
        let (got, clean) = read_all(&mut s).await;
        assert!(got.is_empty() && clean, "{got:?}");
        assert!(
            started.elapsed() >= Duration::from_millis(600),
            "{:?}",
            started.elapsed()
        );
    }

    #[tokio::test]
    async fn a_timeout_with_a_limit_stalls_then_closes_open_and_new_connections() {
        let proxy = FaultProxy::start(echo_server().await).await.unwrap();
        let (mut open, _) = echo(TcpStream::connect(proxy.addr()).await.unwrap())
            .await
            .unwrap();
        proxy.timeout(Duration::from_millis(300));
        let started = std::time::Instant::now();
        open.write_all(b"ping").await.unwrap();
        let (got, _) = read_all(&mut open).await;
        assert!(got.is_empty(), "nothing passes while it stalls: {got:?}");
        assert!(
            started.elapsed() >= Duration::from_millis(300),
            "closed only after the limit: {:?}",
            started.elapsed()
        );
        let started = std::time::Instant::now();
        let mut fresh = TcpStream::connect(proxy.addr()).await.unwrap();
        fresh.write_all(b"ping").await.unwrap();
        let (got, _) = read_all(&mut fresh).await;
        assert!(got.is_empty(), "{got:?}");
        assert!(
            started.elapsed() >= Duration::from_millis(300),
            "{:?}",
            started.elapsed()
        );
        proxy.up();
        let (_, buf) = echo(TcpStream::connect(proxy.addr()).await.unwrap())
            .await
            .unwrap();
        assert_eq!(&buf, b"ping");
    }

    #[tokio::test]
    async fn forwards_then_cuts_then_forwards_again() {
        let proxy = FaultProxy::start(echo_server().await).await.unwrap();
        let (open, buf) = echo(TcpStream::connect(proxy.addr()).await.unwrap())
            .await
            .unwrap();
        assert_eq!(&buf, b"ping");

        proxy.down();
        let mut open = open;
        let mut rest = Vec::new();
        // The open connection is closed: reading ends (EOF or reset).
        let _ = open.read_to_end(&mut rest).await;
        assert!(rest.is_empty());
        let fresh = TcpStream::connect(proxy.addr()).await.unwrap();
        assert!(
            echo(fresh).await.is_err(),
            "a new connection is closed on arrival"
        );

        proxy.up();
        let (_, buf) = echo(TcpStream::connect(proxy.addr()).await.unwrap())
            .await
            .unwrap();
        assert_eq!(&buf, b"ping");
        assert_eq!(proxy.accepted(), 3);

        // Stalled: the open connection and a new one hear nothing, not even a close.
        let (open, _) = echo(TcpStream::connect(proxy.addr()).await.unwrap())
            .await
            .unwrap();
        proxy.stall();
        let silent = |s: TcpStream| async move {
            let mut s = s;
            s.write_all(b"ping").await.unwrap();
            let mut buf = [0u8; 4];
            tokio::time::timeout(std::time::Duration::from_millis(300), s.read(&mut buf))
                .await
                .is_err()
        };
        assert!(
            silent(open).await,
            "no answer, no close on an open connection"
        );
        assert!(
            silent(TcpStream::connect(proxy.addr()).await.unwrap()).await,
            "nor on a new one"
        );
        proxy.up();
        let (_, buf) = echo(TcpStream::connect(proxy.addr()).await.unwrap())
            .await
            .unwrap();
        assert_eq!(&buf, b"ping", "through again once up");
    }
}
