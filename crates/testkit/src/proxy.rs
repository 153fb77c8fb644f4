//! A TCP fault proxy for tests: a test points a store, key store, broker or destination URL at
//! [`FaultProxy::addr`] instead of the service, and cuts the service off at the moment it
//! chooses, in one of the ways Toxiproxy names: `down` (every open connection closed, new ones
//! closed as soon as they are accepted), `reset_peer` (the same with a TCP reset instead of a
//! close: the client reads "connection reset by peer"), `timeout` with no limit, here
//! [`FaultProxy::stall`] (connections stay open, nothing gets through either way: a server that
//! stopped answering, or a network that drops packets), `latency` (every chunk held back a
//! while, both ways, the connections otherwise working) and `slicer` (every chunk passed on in
//! slices of a few bytes, a pause after each: a slow link that still delivers everything).

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
    Stall,
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
                    // Held open, never forwarded; closed once the proxy is up again.
                    Mode::Stall => {
                        tokio::spawn(async move {
                            let _held = client;
                            let _ = cut.wait_for(|m| *m != Mode::Stall).await;
                        });
                    }
                    Mode::Up => {
                        let shaping = shaping.clone();
                        tokio::spawn(async move {
                            let Ok(server) = TcpStream::connect(upstream).await else {
                                return;
                            };
                            forward(client, server, &mut cut, &shaping).await;
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
        self.mode.send_replace(Mode::Down);
    }

    /// Cuts the service off with a TCP reset: open connections and new ones are aborted, and
    /// the client reads "connection reset by peer" rather than an end of stream.
    pub fn reset_peer(&self) {
        self.mode.send_replace(Mode::Reset);
    }

    /// Stops every byte, both ways, on open connections and new ones, which stay open: the
    /// other side hears nothing, not even a close, until [`FaultProxy::up`] closes them.
    pub fn stall(&self) {
        self.mode.send_replace(Mode::Stall);
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

/// Copies both ways until both sides have closed, either fails, or the proxy is cut; while it
/// stalls, copies nothing and keeps both ends open until it is up again, then closes them.
async fn forward(
    mut client: TcpStream,
    mut server: TcpStream,
    cut: &mut watch::Receiver<Mode>,
    toxics: &Toxics,
) {
    let ended = {
        let (client_read, client_write) = client.split();
        let (server_read, server_write) = server.split();
        let copy = async {
            tokio::try_join!(
                pipe(client_read, server_write, toxics),
                pipe(server_read, client_write, toxics)
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
                        (Ok(()), Mode::Up) => {}
                        (Ok(()), Mode::Down | Mode::Reset) => break mode,
                        (Ok(()), Mode::Stall) => {
                            let _ = cut.wait_for(|m| *m != Mode::Stall).await;
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

/// Copies one way, each chunk after the proxy's latency and in its slices; passes the end of
/// stream on.
async fn pipe(
    mut from: impl AsyncRead + Unpin,
    mut to: impl AsyncWrite + Unpin,
    toxics: &Toxics,
) -> std::io::Result<()> {
    let mut buf = vec![0u8; 16 * 1024];
    loop {
        let n = from.read(&mut buf).await?;
        if n == 0 {
            return to.shutdown().await;
        }
        let delay = toxics.latency_us.load(Ordering::SeqCst);
        if delay > 0 {
            tokio::time::sleep(Duration::from_micros(delay)).await;
        }
        let slice = toxics.slice_bytes.load(Ordering::SeqCst);
        if slice == 0 {
            to.write_all(&buf[..n]).await?;
            continue;
        }
        let pause = Duration::from_micros(toxics.slice_pause_us.load(Ordering::SeqCst));
        for piece in buf[..n].chunks(slice) {
            to.write_all(piece).await?;
            to.flush().await?;
            tokio::time::sleep(pause).await;
        }
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
