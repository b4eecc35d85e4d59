//! Shared helpers for the Redis tests: servers, clusters and a stalling proxy,
//! all started by the tests themselves on free ports and killed on drop.
//!
//! Nothing here ever connects to a Redis the tests did not start (in
//! particular not 127.0.0.1:6379). A missing `redis-server` or `redis-cli`
//! fails the test with install instructions; these tests never skip.
#![allow(dead_code, unreachable_pub, missing_docs)]

pub mod process;

use std::io::{Read, Write};
use std::net::{TcpListener, TcpStream};
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::sync::watch;
use tokio::task::AbortHandle;

/// The path of `bin`, or a panic that says how to install it.
pub fn require(bin: &str) -> PathBuf {
    let found = std::env::var_os("PATH").and_then(|paths| {
        std::env::split_paths(&paths)
            .map(|dir| dir.join(bin))
            .find(|p| p.is_file())
    });
    found.unwrap_or_else(|| {
        panic!(
            "`{bin}` was not found on PATH. The Redis tests start their own servers and are never \
             skipped. Install Redis: `sudo apt-get install -y redis-server redis-tools` \
             (Debian/Ubuntu; redis-tools has redis-cli and redis-benchmark), or `brew install redis`."
        )
    })
}

/// A directory under the system temp dir, removed on drop.
#[derive(Debug)]
pub struct TempDir(PathBuf);

impl TempDir {
    pub fn new(tag: &str) -> Self {
        static N: AtomicU64 = AtomicU64::new(0);
        let nanos = SystemTime::now()
            .duration_since(UNIX_EPOCH)
            .map_or(0, |d| d.subsec_nanos());
        let path = std::env::temp_dir().join(format!(
            "tower-admission-{tag}-{}-{}-{nanos}",
            std::process::id(),
            N.fetch_add(1, Ordering::Relaxed)
        ));
        std::fs::create_dir_all(&path).expect("create temp dir");
        TempDir(path)
    }

    pub fn path(&self) -> &Path {
        &self.0
    }
}

impl Drop for TempDir {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.0);
    }
}

/// A free TCP port on 127.0.0.1; for cluster nodes the bus port (+10000) is
/// free too. Never the same port twice in one test binary: the OS may hand
/// a just-released port out again, and two servers of one test (or of two
/// tests running at once) given one port would make one fail to listen
/// while the other answers for it.
pub fn free_port(with_bus: bool) -> u16 {
    static GIVEN: Mutex<Vec<u16>> = Mutex::new(Vec::new());
    let mut given = GIVEN.lock().unwrap_or_else(|e| e.into_inner());
    for _ in 0..100 {
        let listener = TcpListener::bind("127.0.0.1:0").expect("bind 127.0.0.1:0");
        let port = listener.local_addr().expect("local addr").port();
        if port == 6379 || given.contains(&port) {
            continue;
        }
        if with_bus {
            let Some(bus) = port.checked_add(10_000) else {
                continue;
            };
            if given.contains(&bus) || TcpListener::bind(("127.0.0.1", bus)).is_err() {
                continue;
            }
            given.push(bus);
        }
        given.push(port);
        return port;
    }
    panic!("no free port found");
}

/// A `redis-server` process on a free port, without persistence
/// (`--save "" --appendonly no`), killed on drop.
#[derive(Debug)]
pub struct RedisServer {
    port: u16,
    cluster: bool,
    dir: TempDir,
    child: Option<Child>,
}

impl RedisServer {
    /// A standalone server.
    pub fn start() -> Self {
        Self::start_with(false)
    }

    fn start_with(cluster: bool) -> Self {
        require("redis-server");
        for _ in 0..5 {
            let mut server = RedisServer {
                port: free_port(cluster),
                cluster,
                dir: TempDir::new("redis"),
                child: None,
            };
            if server.spawn() {
                return server;
            }
        }
        panic!("redis-server did not start after 5 attempts");
    }

    /// Starts the process on this server's port; false if it did not come up.
    fn spawn(&mut self) -> bool {
        let port = self.port.to_string();
        let mut cmd = Command::new("redis-server");
        cmd.args([
            "--port",
            &port,
            "--bind",
            "127.0.0.1",
            "--save",
            "",
            "--appendonly",
            "no",
        ])
        .args(["--protected-mode", "no", "--daemonize", "no"])
        .arg("--dir")
        .arg(self.dir.path())
        .arg("--logfile")
        .arg(self.dir.path().join("redis.log"));
        if self.cluster {
            cmd.args(["--cluster-enabled", "yes", "--cluster-node-timeout", "2000"])
                .arg("--cluster-config-file")
                .arg(self.dir.path().join("nodes.conf"));
        }
        let mut child = cmd
            .stdin(Stdio::null())
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .spawn()
            .expect("spawn redis-server");
        let started = Instant::now();
        while started.elapsed() < Duration::from_secs(10) {
            if let Ok(Some(_)) = child.try_wait() {
                return false;
            }
            if ping(self.port) {
                self.child = Some(child);
                return true;
            }
            std::thread::sleep(Duration::from_millis(10));
        }
        let _ = child.kill();
        let _ = child.wait();
        false
    }

    pub fn port(&self) -> u16 {
        self.port
    }

    pub fn url(&self) -> String {
        format!("redis://127.0.0.1:{}/", self.port)
    }

    /// SIGKILL: no shutdown, connections drop, all data is gone.
    pub fn kill(&mut self) {
        if let Some(mut child) = self.child.take() {
            let _ = child.kill();
            let _ = child.wait();
        }
    }

    /// Starts the server again on the same port, empty (no persistence).
    pub fn restart(&mut self) {
        self.kill();
        let _ = std::fs::remove_file(self.dir.path().join("nodes.conf"));
        for _ in 0..50 {
            if self.spawn() {
                return;
            }
            std::thread::sleep(Duration::from_millis(20));
        }
        panic!("redis-server did not restart on port {}", self.port);
    }

    /// Runs `redis-cli -p <port> <args>` and returns its stdout.
    pub fn cli(&self, args: &[&str]) -> String {
        cli(self.port, args)
    }
}

impl Drop for RedisServer {
    fn drop(&mut self) {
        self.kill();
    }
}

/// `redis-cli -p port args...`, stdout as a string.
pub fn cli(port: u16, args: &[&str]) -> String {
    require("redis-cli");
    let out = Command::new("redis-cli")
        .args(["-h", "127.0.0.1", "-p", &port.to_string()])
        .args(args)
        .output()
        .expect("run redis-cli");
    String::from_utf8_lossy(&out.stdout).into_owned()
}

/// True if a Redis answers PING on the port.
fn ping(port: u16) -> bool {
    let Ok(mut stream) = TcpStream::connect(("127.0.0.1", port)) else {
        return false;
    };
    let _ = stream.set_read_timeout(Some(Duration::from_millis(500)));
    if stream.write_all(b"PING\r\n").is_err() {
        return false;
    }
    let mut buf = [0u8; 7];
    stream.read_exact(&mut buf).is_ok() && &buf == b"+PONG\r\n"
}

/// Three cluster-enabled masters joined by `redis-cli --cluster create`
/// (no replicas), killed on drop.
#[derive(Debug)]
pub struct RedisCluster {
    nodes: Vec<RedisServer>,
}

impl RedisCluster {
    pub fn start() -> Self {
        require("redis-cli");
        let nodes: Vec<RedisServer> = (0..3).map(|_| RedisServer::start_with(true)).collect();
        let addrs: Vec<String> = nodes
            .iter()
            .map(|n| format!("127.0.0.1:{}", n.port))
            .collect();
        let out = Command::new("redis-cli")
            .arg("--cluster")
            .arg("create")
            .args(&addrs)
            .args(["--cluster-replicas", "0", "--cluster-yes"])
            .output()
            .expect("run redis-cli --cluster create");
        let stdout = String::from_utf8_lossy(&out.stdout);
        assert!(
            stdout.contains("All 16384 slots covered"),
            "redis-cli --cluster create failed:\n{stdout}\n{}",
            String::from_utf8_lossy(&out.stderr)
        );
        // Wait until every node agrees the cluster is up with 3 masters.
        let started = Instant::now();
        loop {
            let ready = nodes.iter().all(|n| {
                let info = n.cli(&["cluster", "info"]);
                info.contains("cluster_state:ok") && info.contains("cluster_known_nodes:3")
            });
            if ready {
                break;
            }
            assert!(
                started.elapsed() < Duration::from_secs(20),
                "cluster did not become ready"
            );
            std::thread::sleep(Duration::from_millis(50));
        }
        RedisCluster { nodes }
    }

    pub fn urls(&self) -> Vec<String> {
        self.nodes.iter().map(RedisServer::url).collect()
    }

    pub fn nodes(&self) -> &[RedisServer] {
        &self.nodes
    }

    /// SIGKILLs node `i`.
    pub fn kill_node(&mut self, i: usize) {
        self.nodes[i].kill();
    }
}

/// A TCP proxy in front of a Redis that can hold all traffic (a stall), or
/// only that of the connections open now (a hung connection, while new ones
/// work): connections stay open, bytes stop moving, until resumed.
#[derive(Debug)]
pub struct StallProxy {
    port: u16,
    held: watch::Sender<Held>,
    /// Connections accepted so far; each is numbered in accept order.
    accepted: Arc<AtomicU64>,
    tasks: Arc<Mutex<Vec<AbortHandle>>>,
}

/// Which connections' traffic is held.
#[derive(Debug, Clone, Copy, Default)]
struct Held {
    all: bool,
    /// Connections numbered below this.
    before: u64,
}

impl Held {
    fn holds(self, connection: u64) -> bool {
        self.all || connection < self.before
    }
}

impl StallProxy {
    /// Listens on a free port and forwards every connection to `upstream`.
    pub async fn start(upstream: u16) -> Self {
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0")
            .await
            .expect("bind proxy");
        let port = listener.local_addr().expect("proxy addr").port();
        let (held, _) = watch::channel(Held::default());
        let accepted = Arc::new(AtomicU64::new(0));
        let tasks: Arc<Mutex<Vec<AbortHandle>>> = Arc::default();
        let accept = {
            let held = held.clone();
            let accepted = accepted.clone();
            let tasks = tasks.clone();
            tokio::spawn(async move {
                loop {
                    let Ok((client, _)) = listener.accept().await else {
                        return;
                    };
                    let n = accepted.fetch_add(1, Ordering::SeqCst);
                    let Ok(server) = tokio::net::TcpStream::connect(("127.0.0.1", upstream)).await
                    else {
                        continue;
                    };
                    let _ = client.set_nodelay(true);
                    let _ = server.set_nodelay(true);
                    let (cr, cw) = client.into_split();
                    let (sr, sw) = server.into_split();
                    let up = tokio::spawn(pump(cr, sw, held.subscribe(), n));
                    let down = tokio::spawn(pump(sr, cw, held.subscribe(), n));
                    let mut tasks = tasks.lock().unwrap();
                    tasks.push(up.abort_handle());
                    tasks.push(down.abort_handle());
                }
            })
        };
        tasks.lock().unwrap().push(accept.abort_handle());
        StallProxy {
            port,
            held,
            accepted,
            tasks,
        }
    }

    pub fn url(&self) -> String {
        format!("redis://127.0.0.1:{}/", self.port)
    }

    /// Stops moving bytes in both directions; connections stay open.
    pub fn stall(&self) {
        self.held.send_modify(|h| h.all = true);
    }

    /// Stops moving bytes on the connections open now (they hang, open);
    /// connections opened later work.
    pub fn stall_open_connections(&self) {
        let before = self.accepted.load(Ordering::SeqCst);
        self.held.send_modify(|h| h.before = before);
    }

    /// Delivers everything held and moves bytes again.
    pub fn resume(&self) {
        self.held.send_replace(Held::default());
    }
}

impl Drop for StallProxy {
    fn drop(&mut self) {
        for task in self.tasks.lock().unwrap().drain(..) {
            task.abort();
        }
    }
}

async fn pump(
    mut from: tokio::net::tcp::OwnedReadHalf,
    mut to: tokio::net::tcp::OwnedWriteHalf,
    mut held: watch::Receiver<Held>,
    connection: u64,
) {
    let mut buf = vec![0u8; 64 * 1024];
    loop {
        let n = match from.read(&mut buf).await {
            Ok(0) | Err(_) => return,
            Ok(n) => n,
        };
        // Bytes read during a stall are held here until it ends.
        if held.wait_for(|h| !h.holds(connection)).await.is_err() {
            return;
        }
        if to.write_all(&buf[..n]).await.is_err() {
            return;
        }
    }
}

/// A proptest runner of `cases` random sequences, or `PROPTEST_CASES` when
/// set, that keeps no regression files.
pub fn runner(cases: u32) -> proptest::test_runner::TestRunner {
    let cases = std::env::var("PROPTEST_CASES")
        .ok()
        .and_then(|n| n.parse().ok())
        .unwrap_or(cases);
    proptest::test_runner::TestRunner::new(proptest::test_runner::Config {
        cases,
        failure_persistence: None,
        ..proptest::test_runner::Config::default()
    })
}

/// The commands clients sent to the server on `port`, from `INFO
/// commandstats`: script calls (`EVALSHA`, `EVAL`, `SCRIPT`) and connection
/// set-up (`HELLO`, `CLIENT`, `PING`, `SELECT`, `AUTH`). The commands a script
/// runs inside Redis are listed there too, but are not round trips, so they
/// are left out. `CONFIG RESETSTAT` starts the count again.
pub fn client_command_calls(server: &RedisServer) -> u64 {
    const CLIENT_COMMANDS: [&str; 8] = [
        "evalsha", "eval", "script", "hello", "client", "ping", "select", "auth",
    ];
    command_calls(server, &CLIENT_COMMANDS)
}

/// The calls of the named commands (lower case, e.g. `evalsha`, or `client`
/// for every `client|...` subcommand) in `INFO commandstats`.
pub fn command_calls(server: &RedisServer, commands: &[&str]) -> u64 {
    server
        .cli(&["INFO", "commandstats"])
        .lines()
        .filter_map(|l| {
            let (name, stats) = l.strip_prefix("cmdstat_")?.split_once(':')?;
            let base = name.split('|').next()?;
            if !commands.contains(&base) {
                return None;
            }
            stats
                .strip_prefix("calls=")?
                .split(',')
                .next()?
                .parse::<u64>()
                .ok()
        })
        .sum()
}

/// A TCP proxy in front of a Redis that, once [armed](Self::cut_next_reply),
/// forwards the next request but closes the connection when the reply
/// comes back, before delivering it: the command ran, the client never
/// learns its answer.
#[derive(Debug)]
pub struct ReplyCutProxy {
    port: u16,
    armed: Arc<std::sync::atomic::AtomicBool>,
    /// Replies cut so far.
    cut: Arc<AtomicU64>,
    tasks: Arc<Mutex<Vec<AbortHandle>>>,
}

impl ReplyCutProxy {
    /// Listens on a free port and forwards every connection to `upstream`.
    pub async fn start(upstream: u16) -> Self {
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0")
            .await
            .expect("bind proxy");
        let port = listener.local_addr().expect("proxy addr").port();
        let armed = Arc::new(std::sync::atomic::AtomicBool::new(false));
        let cut = Arc::new(AtomicU64::new(0));
        let tasks: Arc<Mutex<Vec<AbortHandle>>> = Arc::default();
        let accept = {
            let (armed, cut, tasks) = (armed.clone(), cut.clone(), tasks.clone());
            tokio::spawn(async move {
                loop {
                    let Ok((client, _)) = listener.accept().await else {
                        return;
                    };
                    let Ok(server) = tokio::net::TcpStream::connect(("127.0.0.1", upstream)).await
                    else {
                        continue;
                    };
                    let _ = client.set_nodelay(true);
                    let _ = server.set_nodelay(true);
                    let (mut cr, mut cw) = client.into_split();
                    let (mut sr, mut sw) = server.into_split();
                    let up = tokio::spawn(async move {
                        let _ = tokio::io::copy(&mut cr, &mut sw).await;
                    });
                    let up_handle = up.abort_handle();
                    let (armed, cut) = (armed.clone(), cut.clone());
                    let down = tokio::spawn(async move {
                        let mut buf = vec![0u8; 64 * 1024];
                        loop {
                            let n = match sr.read(&mut buf).await {
                                Ok(0) | Err(_) => break,
                                Ok(n) => n,
                            };
                            if armed.swap(false, Ordering::SeqCst) {
                                cut.fetch_add(1, Ordering::SeqCst);
                                break;
                            }
                            if cw.write_all(&buf[..n]).await.is_err() {
                                break;
                            }
                        }
                        // Closing both halves: the client sees the connection drop.
                        up_handle.abort();
                    });
                    let mut tasks = tasks.lock().unwrap();
                    tasks.push(up.abort_handle());
                    tasks.push(down.abort_handle());
                }
            })
        };
        tasks.lock().unwrap().push(accept.abort_handle());
        ReplyCutProxy {
            port,
            armed,
            cut,
            tasks,
        }
    }

    pub fn port(&self) -> u16 {
        self.port
    }

    pub fn url(&self) -> String {
        format!("redis://127.0.0.1:{}/", self.port)
    }

    /// Cuts the connection that carries the next reply, once.
    pub fn cut_next_reply(&self) {
        self.armed.store(true, Ordering::SeqCst);
    }

    /// Replies cut so far.
    pub fn cuts(&self) -> u64 {
        self.cut.load(Ordering::SeqCst)
    }
}

impl Drop for ReplyCutProxy {
    fn drop(&mut self) {
        for task in self.tasks.lock().unwrap().drain(..) {
            task.abort();
        }
    }
}

impl RedisCluster {
    /// Puts a [`ReplyCutProxy`] in front of every node and has each node
    /// announce its proxy's port, so cluster clients reach the nodes only
    /// through the proxies. Returns the proxies in node order.
    pub async fn behind_reply_cut_proxies(&self) -> Vec<ReplyCutProxy> {
        let mut proxies = Vec::new();
        for node in &self.nodes {
            let proxy = ReplyCutProxy::start(node.port).await;
            let port = proxy.port().to_string();
            assert_eq!(
                node.cli(&["config", "set", "cluster-announce-port", &port])
                    .trim(),
                "OK"
            );
            proxies.push(proxy);
        }
        // Wait until every node's slot map names the proxies only.
        let started = Instant::now();
        loop {
            let ready = self.nodes.iter().all(|n| {
                let slots = n.cli(&["cluster", "slots"]);
                proxies
                    .iter()
                    .all(|p| slots.lines().any(|l| l.trim() == p.port().to_string()))
                    && self
                        .nodes
                        .iter()
                        .all(|m| !slots.lines().any(|l| l.trim() == m.port.to_string()))
            });
            if ready {
                break;
            }
            assert!(
                started.elapsed() < Duration::from_secs(20),
                "nodes did not announce their proxies"
            );
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
        proxies
    }
}
