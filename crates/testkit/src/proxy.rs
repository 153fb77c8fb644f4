//! A TCP fault proxy for tests: a test points a store, key store, broker or destination URL at
//! [`FaultProxy::addr`] instead of the service, and cuts the service off at the moment it
//! chooses, in one of two ways Toxiproxy names: `down` (every open connection closed, new ones
//! closed as soon as they are accepted) or `timeout` with no limit, here [`FaultProxy::stall`]
//! (connections stay open, nothing gets through either way: a server that stopped answering,
//! or a network that drops packets).

use std::net::SocketAddr;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;

use tokio::net::{TcpListener, TcpStream};
use tokio::sync::watch;
use tokio::task::JoinHandle;

/// What the proxy does with connections.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Mode {
    Up,
    Down,
    Stall,
}

/// A forwarder from a loopback port to `upstream`, with a switch.
pub struct FaultProxy {
    addr: SocketAddr,
    down: watch::Sender<Mode>,
    accepted: Arc<AtomicUsize>,
    task: JoinHandle<()>,
}

impl FaultProxy {
    /// Listens on a free loopback port and forwards every connection to `upstream`.
    pub async fn start(upstream: SocketAddr) -> std::io::Result<FaultProxy> {
        let listener = TcpListener::bind("127.0.0.1:0").await?;
        let addr = listener.local_addr()?;
        let (down, watching) = watch::channel(Mode::Up);
        let accepted = Arc::new(AtomicUsize::new(0));
        let count = accepted.clone();
        let task = tokio::spawn(async move {
            while let Ok((client, _)) = listener.accept().await {
                count.fetch_add(1, Ordering::SeqCst);
                let mut cut = watching.clone();
                let mode = *cut.borrow_and_update();
                match mode {
                    Mode::Down => drop(client),
                    // Held open, never forwarded; closed once the proxy is up again.
                    Mode::Stall => {
                        tokio::spawn(async move {
                            let _held = client;
                            let _ = cut.wait_for(|m| *m != Mode::Stall).await;
                        });
                    }
                    Mode::Up => {
                        tokio::spawn(async move {
                            let Ok(server) = TcpStream::connect(upstream).await else {
                                return;
                            };
                            forward(client, server, &mut cut).await;
                        });
                    }
                }
            }
        });
        Ok(FaultProxy {
            addr,
            down,
            accepted,
            task,
        })
    }

    /// Where to connect instead of the service.
    pub fn addr(&self) -> SocketAddr {
        self.addr
    }

    /// Cuts the service off: open connections are closed, new ones closed on arrival.
    pub fn down(&self) {
        self.down.send_replace(Mode::Down);
    }

    /// Stops every byte, both ways, on open connections and new ones, which stay open: the
    /// other side hears nothing, not even a close, until [`FaultProxy::up`] closes them.
    pub fn stall(&self) {
        self.down.send_replace(Mode::Stall);
    }

    /// Lets connections through again (the ones closed or stalled are closed).
    pub fn up(&self) {
        self.down.send_replace(Mode::Up);
    }

    /// How many connections the proxy has accepted, cut ones included.
    pub fn accepted(&self) -> usize {
        self.accepted.load(Ordering::SeqCst)
    }
}

impl Drop for FaultProxy {
    fn drop(&mut self) {
        self.task.abort();
        self.down.send_replace(Mode::Down);
    }
}

/// Copies both ways until either side closes or the proxy goes down; while it stalls, copies
/// nothing and keeps both ends open until it is up again, then closes them.
async fn forward(mut client: TcpStream, mut server: TcpStream, cut: &mut watch::Receiver<Mode>) {
    let copy = tokio::io::copy_bidirectional(&mut client, &mut server);
    tokio::pin!(copy);
    loop {
        tokio::select! {
            _ = &mut copy => return,
            changed = cut.changed() => {
                let mode = *cut.borrow_and_update();
                if changed.is_err() || mode == Mode::Down {
                    return;
                }
                if mode == Mode::Stall {
                    let _ = cut.wait_for(|m| *m != Mode::Stall).await;
                    return;
                }
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use tokio::io::{AsyncReadExt, AsyncWriteExt};

    use super::*;

    #[tokio::test]
    async fn forwards_then_cuts_then_forwards_again() {
        // An echo server upstream.
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
        let proxy = FaultProxy::start(upstream_addr).await.unwrap();
        let echo = |mut s: TcpStream| async move {
            s.write_all(b"ping").await?;
            let mut buf = [0u8; 4];
            s.read_exact(&mut buf).await?;
            Ok::<_, std::io::Error>((s, buf))
        };
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
