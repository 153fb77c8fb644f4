//! A TCP fault proxy for tests: a test points a store, key store, broker or destination URL at
//! [`FaultProxy::addr`] instead of the service, and cuts the service off at the moment it
//! chooses. Named after Toxiproxy's `down` toxic, which it plays: while down, every open
//! connection is closed and new ones are closed as soon as they are accepted.

use std::net::SocketAddr;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;

use tokio::net::{TcpListener, TcpStream};
use tokio::sync::watch;
use tokio::task::JoinHandle;

/// A forwarder from a loopback port to `upstream`, with a switch.
pub struct FaultProxy {
    addr: SocketAddr,
    down: watch::Sender<bool>,
    accepted: Arc<AtomicUsize>,
    task: JoinHandle<()>,
}

impl FaultProxy {
    /// Listens on a free loopback port and forwards every connection to `upstream`.
    pub async fn start(upstream: SocketAddr) -> std::io::Result<FaultProxy> {
        let listener = TcpListener::bind("127.0.0.1:0").await?;
        let addr = listener.local_addr()?;
        let (down, watching) = watch::channel(false);
        let accepted = Arc::new(AtomicUsize::new(0));
        let count = accepted.clone();
        let task = tokio::spawn(async move {
            while let Ok((client, _)) = listener.accept().await {
                count.fetch_add(1, Ordering::SeqCst);
                let mut cut = watching.clone();
                if *cut.borrow_and_update() {
                    drop(client);
                    continue;
                }
                tokio::spawn(async move {
                    let Ok(server) = TcpStream::connect(upstream).await else {
                        return;
                    };
                    forward(client, server, &mut cut).await;
                });
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
        self.down.send_replace(true);
    }

    /// Lets connections through again (the ones closed stay closed).
    pub fn up(&self) {
        self.down.send_replace(false);
    }

    /// How many connections the proxy has accepted, cut ones included.
    pub fn accepted(&self) -> usize {
        self.accepted.load(Ordering::SeqCst)
    }
}

impl Drop for FaultProxy {
    fn drop(&mut self) {
        self.task.abort();
        self.down.send_replace(true);
    }
}

/// Copies both ways until either side closes or the proxy goes down.
async fn forward(mut client: TcpStream, mut server: TcpStream, cut: &mut watch::Receiver<bool>) {
    let copy = tokio::io::copy_bidirectional(&mut client, &mut server);
    tokio::pin!(copy);
    loop {
        tokio::select! {
            _ = &mut copy => return,
            changed = cut.changed() => {
                if changed.is_err() || *cut.borrow_and_update() {
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
    }
}
