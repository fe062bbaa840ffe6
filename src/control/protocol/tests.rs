//! The protocol cores stepped against each other in memory (quinn-proto's
//! `Pair`): a client core and a server core joined by a simulated link that
//! can drop, duplicate and reorder frames, over simulated files, windows and
//! a data path that can damage blocks, with every I/O action answered in a
//! random order. No device, no sockets, no files.

use std::collections::{BTreeMap, HashMap, HashSet, VecDeque};

use proptest::prelude::*;
use sha2::{Digest as _, Sha256};

use super::*;
use crate::proto::{self, ClientFrame, Direction, ServerFrame};

/// The handshake's decisions (`negotiate`, `check_grant`), the rails'
/// watch, and sessions run with what they agreed.
mod negotiation;

/// Buffer operations' cores, alone and as a Pair over a lossy link.
mod buffer;

/// A small deterministic generator (xorshift64*).
#[derive(Clone, Debug)]
struct Rng(u64);

impl Rng {
    fn new(seed: u64) -> Self {
        Rng(seed.wrapping_mul(0x9E37_79B9_7F4A_7C15) | 1)
    }
    fn next(&mut self) -> u64 {
        let mut x = self.0;
        x ^= x >> 12;
        x ^= x << 25;
        x ^= x >> 27;
        self.0 = x;
        x.wrapping_mul(0x2545_F491_4F6C_DD1D)
    }
    fn below(&mut self, n: u64) -> u64 {
        if n == 0 {
            0
        } else {
            self.next() % n
        }
    }
    fn chance(&mut self, p: f64) -> bool {
        (self.next() >> 11) as f64 / (1u64 << 53) as f64 <= p && p > 0.0
    }
}

/// A block's digest under `check`, as on the wire.
fn digest(check: crate::files::Check, b: &[u8]) -> Vec<u8> {
    check.wire(&check.block(b))
}

fn content(len: usize, seed: u64) -> Vec<u8> {
    let mut r = Rng::new(seed + 7);
    (0..len).map(|_| r.next() as u8).collect()
}

/// What can go wrong on the way.
#[derive(Clone, Copy, Debug, Default)]
struct Faults {
    /// A block damaged in flight (the receiver's digest check catches it).
    damage: f64,
    /// Frames lost, duplicated, delivered out of order.
    drop: f64,
    dup: f64,
    reorder: bool,
}

/// A file on the receiving side.
#[derive(Clone, Debug)]
struct Dest {
    len: u64,
    data: Vec<u8>,
    digests: BTreeMap<u64, Vec<u8>>,
}

/// What the harness saw, checked at the end.
#[derive(Debug, Default)]
struct Seen {
    /// (file, block) verified by the receiver.
    verified: HashSet<(FileId, u64)>,
    /// Blocks moved after they had been verified (must stay empty).
    resent_verified: Vec<(FileId, u64)>,
    /// Files published under their final name: (file, bytes).
    published: Vec<(FileId, Vec<u8>)>,
    /// Releases per window.
    released: HashMap<WindowId, u32>,
    granted: HashSet<WindowId>,
    most_windows: usize,
    client_end: Option<Result<(), Failure>>,
    server_end: Option<Result<(), Failure>>,
    done_events: Vec<FileId>,
    damaged: u64,
    /// When each end ended (simulated ns).
    client_end_at: Option<u64>,
    server_end_at: Option<u64>,
    /// Frames the link lost or delivered out of order, and when the first
    /// was.
    lost: u64,
    first_lost_at: Option<u64>,
    /// The step at which the server's End was seen.
    server_end_step: Option<usize>,
    /// A forged frame was handed to the server (at this step), and the
    /// server's I/O actions after it (must stay empty).
    forged_at: Option<usize>,
    acted_after_forgery: Vec<String>,
}

/// What crosses the simulated link: a frame, or the end of one side of the
/// stream (never lost: a broken stream is noticed too).
#[derive(Clone, Debug)]
enum Msg<F> {
    Frame(F),
    Close(Result<(), Failure>),
}

enum Io {
    Server(ServerAction),
    Client(ClientAction),
}

struct Sim {
    p: Params,
    dir: Direction,
    rng: Rng,
    faults: Faults,
    now: u64,
    server: ServerCore,
    client: ClientCore,
    to_server: Vec<(u64, Msg<ClientFrame>)>,
    to_client: Vec<(u64, Msg<ServerFrame>)>,
    io: Vec<Io>,
    /// Sources by path (push: the client's files; pull: the server's).
    sources: HashMap<String, Vec<u8>>,
    /// The client's file id -> its path (both directions).
    paths: HashMap<FileId, String>,
    /// Server-side file id -> path (from OpenFile).
    server_paths: HashMap<FileId, String>,
    /// Window memory on the server and who may reach it now.
    windows: HashMap<WindowId, Vec<u8>>,
    rkeys: HashMap<WindowId, u32>,
    next_rkey: u32,
    /// Receiving side's files (push: server's; pull: client's).
    dests: HashMap<FileId, Dest>,
    seen: Seen,
    /// Steps run so far.
    steps: usize,
    /// Hand this out-of-protocol frame to the server at this step.
    forge: Option<(usize, Forgery)>,
}

/// Messages a client may not send (`Sim::forge`).
#[derive(Clone, Copy, Debug)]
enum Forgery {
    /// A WindowDone for window 0 (ids start at 1).
    WindowZero,
    /// A WindowDone for the next window, not granted yet.
    WindowNotYet,
    /// A WindowDone for a window far past any granted.
    WindowFar,
    /// A FileEnd for file 0.
    FileZero,
    /// A FileEnd for a file id the client never opened.
    FileNever,
    /// An OpenFile of file 0.
    OpenZero,
}

impl Forgery {
    const ALL: [Forgery; 6] = [
        Forgery::WindowZero,
        Forgery::WindowNotYet,
        Forgery::WindowFar,
        Forgery::FileZero,
        Forgery::FileNever,
        Forgery::OpenZero,
    ];

    /// The frame, and the words its violation must be named by.
    fn frame(self, server: &ServerCore, files: usize) -> (ClientFrame, &'static str) {
        let done = |window| ClientFrame {
            done: vec![proto::WindowDone {
                window,
                digests: vec![vec![0; 32]],
                ..Default::default()
            }],
            ..Default::default()
        };
        let end = |file| ClientFrame {
            end: vec![proto::FileEnd {
                file,
                digest: vec![0; 32],
            }],
            ..Default::default()
        };
        match self {
            Forgery::WindowZero => (done(0), "WindowDone: window 0 was never granted"),
            Forgery::WindowNotYet => (done(server.next_window()), "was never granted"),
            Forgery::WindowFar => (done(u64::MAX), "was never granted"),
            Forgery::FileZero => (end(0), "FileEnd: file 0 was never opened"),
            Forgery::FileNever => (end(files as u32 + 7), "was never opened"),
            Forgery::OpenZero => (
                ClientFrame {
                    open: vec![proto::OpenFile {
                        file: 0,
                        direction: Direction::Push as i32,
                        ..Default::default()
                    }],
                    ..Default::default()
                },
                "OpenFile: file id 0 is reserved",
            ),
        }
    }
}

impl Sim {
    fn new(p: Params, dir: Direction, files: &[u64], faults: Faults, seed: u64) -> Sim {
        Sim::pair(p, p, dir, files, faults, seed)
    }

    /// Each end with its own parameters (as negotiated: the same blocks and
    /// windows, each end's own timeout).
    fn pair(
        p: Params,
        client: Params,
        dir: Direction,
        files: &[u64],
        faults: Faults,
        seed: u64,
    ) -> Sim {
        let mut sim = Sim {
            p,
            dir,
            rng: Rng::new(seed),
            faults,
            now: 1,
            server: ServerCore::new(p, 1),
            client: ClientCore::new(client, 77, 1),
            to_server: Vec::new(),
            to_client: Vec::new(),
            io: Vec::new(),
            sources: HashMap::new(),
            paths: HashMap::new(),
            server_paths: HashMap::new(),
            windows: HashMap::new(),
            rkeys: HashMap::new(),
            next_rkey: 1,
            dests: HashMap::new(),
            seen: Seen::default(),
            steps: 0,
            forge: None,
        };
        for (i, &len) in files.iter().enumerate() {
            let path = format!("d/f{i}");
            sim.sources
                .insert(path.clone(), content(len as usize, seed ^ i as u64));
            let id = sim.client.add_file(FileSpec {
                direction: dir,
                remote: path.clone(),
                ..FileSpec::default()
            });
            sim.paths.insert(id, path);
        }
        sim.client.finish();
        sim
    }

    fn ended(&self) -> bool {
        self.seen.client_end.is_some() && self.seen.server_end.is_some()
    }

    /// Run until both ends are over (or `steps` run out: a hang).
    fn run(&mut self, steps: usize) {
        for _ in 0..steps {
            self.collect();
            if self.seen.server_end.is_some() {
                self.seen.server_end_step.get_or_insert(self.steps);
            }
            if self.ended() {
                return;
            }
            if let Some((at, f)) = self.forge {
                if at == self.steps && self.seen.server_end.is_none() {
                    let (frame, _) = f.frame(&self.server, self.paths.len());
                    self.seen.forged_at = Some(self.steps);
                    self.server.handle_frame(self.now, frame);
                }
            }
            self.steps += 1;
            self.step();
        }
        panic!(
            "no end after {steps} steps: client {:?} server {:?}",
            self.seen.client_end, self.seen.server_end
        );
    }

    /// Take every action and frame the cores have now.
    fn collect(&mut self) {
        loop {
            let mut any = false;
            while let Some(a) = self.server.poll_action() {
                any = true;
                self.server_action_now(a);
            }
            while let Some(a) = self.client.poll_action() {
                any = true;
                self.client_action_now(a);
            }
            while let Some(ev) = self.client.poll_event() {
                let ClientEvent::FileDone(d) = ev;
                self.seen.done_events.push(d.file);
            }
            if let Some(f) = self.server.poll_frame(self.now) {
                any = true;
                self.link_to_client(Msg::Frame(f));
            }
            if let Some(f) = self.client.poll_frame(self.now) {
                any = true;
                self.link_to_server(Msg::Frame(f));
            }
            self.seen.most_windows = self.seen.most_windows.max(self.server.windows_live());
            if !any {
                return;
            }
        }
    }

    fn latency(&mut self) -> u64 {
        if self.faults.reorder {
            self.now + 1 + self.rng.below(5_000_000)
        } else {
            // In order: later than anything already in flight.
            self.now + 100_000
        }
    }

    fn link_to_server(&mut self, m: Msg<ClientFrame>) {
        let close = matches!(m, Msg::Close(_));
        if !close && self.rng.chance(self.faults.drop) {
            self.seen.lost += 1;
            self.seen.first_lost_at.get_or_insert(self.now);
            return;
        }
        let n = if !close && self.rng.chance(self.faults.dup) {
            2
        } else {
            1
        };
        for _ in 0..n {
            let mut at = self.latency().max(self.to_server.last().map_or(0, |x| x.0));
            if close {
                at = at.max(self.to_server.iter().map(|x| x.0).max().unwrap_or(0)) + 1;
            }
            self.to_server.push((at, m.clone()));
        }
    }

    fn link_to_client(&mut self, m: Msg<ServerFrame>) {
        let close = matches!(m, Msg::Close(_));
        if !close && self.rng.chance(self.faults.drop) {
            self.seen.lost += 1;
            self.seen.first_lost_at.get_or_insert(self.now);
            return;
        }
        let n = if !close && self.rng.chance(self.faults.dup) {
            2
        } else {
            1
        };
        for _ in 0..n {
            let mut at = self.latency().max(self.to_client.last().map_or(0, |x| x.0));
            if close {
                at = at.max(self.to_client.iter().map(|x| x.0).max().unwrap_or(0)) + 1;
            }
            self.to_client.push((at, m.clone()));
        }
    }

    /// Deliver a frame, answer an action, or let time pass.
    fn step(&mut self) {
        let mut choices = Vec::new();
        if !self.to_server.is_empty() {
            choices.push(0);
        }
        if !self.to_client.is_empty() {
            choices.push(1);
        }
        if !self.io.is_empty() {
            choices.push(2);
            choices.push(2);
        }
        if choices.is_empty() {
            // Nothing moves: time passes to the next timer.
            let t = [self.server.poll_timeout(), self.client.poll_timeout()]
                .into_iter()
                .flatten()
                .min();
            match t {
                Some(t) => self.now = self.now.max(t),
                None => self.now += 1_000_000_000,
            }
            self.server.handle_timeout(self.now);
            self.client.handle_timeout(self.now);
            return;
        }
        self.now += self.rng.below(200_000);
        match choices[self.rng.below(choices.len() as u64) as usize] {
            0 => {
                let i = self.pick(self.to_server.iter().map(|x| x.0).collect());
                let (at, f) = self.to_server.remove(i);
                self.now = self.now.max(at);
                match f {
                    Msg::Frame(f) => self.server.handle_frame(self.now, f),
                    Msg::Close(_) => self.server.client_closed(self.now),
                }
            }
            1 => {
                let i = self.pick(self.to_client.iter().map(|x| x.0).collect());
                let (at, f) = self.to_client.remove(i);
                self.now = self.now.max(at);
                match f {
                    Msg::Frame(f) => self.client.handle_frame(self.now, f),
                    Msg::Close(r) => self.client.server_closed(self.now, r),
                }
            }
            _ => {
                let i = self.rng.below(self.io.len() as u64) as usize;
                let io = self.io.swap_remove(i);
                match io {
                    Io::Server(a) => self.server_answer(a),
                    Io::Client(a) => self.client_answer(a),
                }
            }
        }
        self.server.handle_timeout(self.now);
        self.client.handle_timeout(self.now);
    }

    /// The frame to deliver next: the earliest (in order), or any (reorder).
    fn pick(&mut self, ats: Vec<u64>) -> usize {
        if self.faults.reorder {
            self.rng.below(ats.len() as u64) as usize
        } else {
            (0..ats.len()).min_by_key(|&i| ats[i]).expect("not empty")
        }
    }

    fn server_action_now(&mut self, a: ServerAction) {
        if self.seen.forged_at.is_some()
            && !matches!(
                a,
                ServerAction::End(_) | ServerAction::Release { .. } | ServerAction::Close { .. }
            )
        {
            self.seen.acted_after_forgery.push(format!("{a:?}"));
        }
        match a {
            ServerAction::Release { window } => {
                assert!(
                    self.seen.granted.contains(&window),
                    "release of {window} never granted"
                );
                *self.seen.released.entry(window).or_default() += 1;
                self.rkeys.remove(&window);
                self.windows.remove(&window);
            }
            ServerAction::Close { .. } => {}
            ServerAction::End(r) => {
                assert!(self.seen.server_end.is_none(), "server ended twice");
                self.seen.server_end = Some(r.clone());
                self.seen.server_end_at = Some(self.now);
                // What is queued goes out, then the status.
                while let Some(f) = self.server.poll_frame(self.now) {
                    self.link_to_client(Msg::Frame(f));
                }
                self.link_to_client(Msg::Close(r));
            }
            other => self.io.push(Io::Server(other)),
        }
    }

    fn client_action_now(&mut self, a: ClientAction) {
        match a {
            ClientAction::Close { .. } => {}
            ClientAction::End(r) => {
                assert!(self.seen.client_end.is_none(), "client ended twice");
                self.seen.client_end = Some(r.clone());
                self.seen.client_end_at = Some(self.now);
                // What is queued (an Abort) goes out, then the client
                // half-closes its side.
                while let Some(f) = self.client.poll_frame(self.now) {
                    self.link_to_server(Msg::Frame(f));
                }
                self.link_to_server(Msg::Close(r));
            }
            other => self.io.push(Io::Client(other)),
        }
    }

    fn block<'a>(&self, data: &'a [u8], b: u64, len: u32) -> &'a [u8] {
        let s = (b * self.p.block_size) as usize;
        &data[s..s + len as usize]
    }

    fn server_answer(&mut self, a: ServerAction) {
        let (now, check) = (self.now, self.p.check);
        match a {
            ServerAction::Open { file, open } => {
                self.server_paths.insert(file, open.path.clone());
                let r = match self.dir {
                    Direction::Push => {
                        self.dests.insert(
                            file,
                            Dest {
                                len: open.length,
                                data: vec![0; open.length as usize],
                                digests: BTreeMap::new(),
                            },
                        );
                        Ok(OpenedFile {
                            length: open.length,
                            path: open.path.clone(),
                            ..OpenedFile::default()
                        })
                    }
                    _ => match self.sources.get(&open.path) {
                        Some(d) => Ok(OpenedFile {
                            length: d.len() as u64,
                            path: open.path.clone(),
                            ..OpenedFile::default()
                        }),
                        None => Err(Failure::new(Reason::FileNotFound, "no such file")),
                    },
                };
                self.server.opened(now, file, r);
            }
            ServerAction::Grant {
                window,
                round,
                extents,
                fill,
            } => {
                self.seen.granted.insert(window);
                let mem = self
                    .windows
                    .entry(window)
                    .or_insert_with(|| vec![0; self.p.window_size as usize]);
                let mut digests = Vec::new();
                if fill {
                    for e in &extents {
                        let path = &self.server_paths[&e.file];
                        let src = &self.sources[path];
                        let s = (e.block * self.p.block_size) as usize;
                        let b = &src[s..s + e.len as usize];
                        mem[e.offset as usize..e.offset as usize + e.len as usize]
                            .copy_from_slice(b);
                        digests.push(digest(check, b));
                    }
                }
                let rkey = self.next_rkey;
                self.next_rkey += 1;
                self.rkeys.insert(window, rkey);
                self.server.granted(
                    now,
                    window,
                    round,
                    Ok(Granted {
                        addr: window << 32,
                        rkey,
                        rail_rkeys: Vec::new(),
                        digests,
                    }),
                );
            }
            ServerAction::Verify {
                window,
                round,
                extents,
                expected,
            } => {
                self.rkeys.remove(&window);
                let mut bad = Vec::new();
                for (i, (e, want)) in extents.iter().zip(&expected).enumerate() {
                    let mem = &self.windows[&window];
                    let got = &mem[e.offset as usize..e.offset as usize + e.len as usize];
                    if digest(check, got) != *want {
                        bad.push(i as u32);
                        continue;
                    }
                    let got = got.to_vec();
                    let d = self.dests.get_mut(&e.file).expect("opened");
                    let s = (e.block * self.p.block_size) as usize;
                    d.data[s..s + got.len()].copy_from_slice(&got);
                    d.digests.insert(e.block, digest(check, &got));
                    self.seen.verified.insert((e.file, e.block));
                }
                self.server.verified(now, window, round, Ok(bad));
            }
            ServerAction::Hash { file, blocks } => {
                let src = &self.sources[&self.server_paths[&file]];
                let len = src.len() as u64;
                let ds = blocks
                    .iter()
                    .map(|&b| {
                        (
                            b,
                            digest(check, self.block(src, b, self.p.block_len(len, b))),
                        )
                    })
                    .collect();
                self.server.hashed(now, file, Ok(ds));
            }
            ServerAction::CheckSource { file } => self.server.source_checked(now, file, Ok(())),
            ServerAction::Commit { files } => {
                for (file, want) in files {
                    let r = self.publish(file, &want);
                    self.server.committed(
                        now,
                        file,
                        r.map(|digest| CommittedFile {
                            digest,
                            path: self.server_paths[&file].clone(),
                            ..CommittedFile::default()
                        }),
                    );
                }
            }
            other => panic!("not an I/O action: {other:?}"),
        }
    }

    /// Seal a received file: every block there, the derived digest equal.
    fn publish(&mut self, file: FileId, want: &[u8]) -> Result<Vec<u8>, Failure> {
        let d = self.dests.remove(&file).expect("a destination");
        let n = self.p.blocks(d.len);
        assert_eq!(
            d.digests.len() as u64,
            n,
            "file {file} committed with blocks missing"
        );
        let mut chain = DigestChain::new(self.p.check, d.len, self.p.block_size);
        for (&b, dg) in &d.digests {
            chain.add(b, dg.clone());
        }
        let got = chain.finish().unwrap_or_default();
        if got != want {
            return Err(Failure::new(Reason::Integrity, "file digest differs"));
        }
        self.seen.published.push((file, d.data));
        Ok(got)
    }

    fn client_answer(&mut self, a: ClientAction) {
        let (now, check) = (self.now, self.p.check);
        match a {
            ClientAction::OpenSource { file } => {
                let len = self.sources[&self.paths[&file]].len() as u64;
                self.client.source_ready(
                    now,
                    file,
                    Ok(SourceMeta {
                        length: len,
                        ..SourceMeta::default()
                    }),
                );
            }
            ClientAction::FindResume { file } => self.client.resume_found(now, file, Ok(None)),
            ClientAction::CreateDest { file, opened } => {
                self.dests.insert(
                    file,
                    Dest {
                        len: opened.length,
                        data: vec![0; opened.length as usize],
                        digests: BTreeMap::new(),
                    },
                );
                self.client.dest_ready(now, file, Ok(()));
            }
            ClientAction::Send { grant } => {
                assert_eq!(
                    self.rkeys.get(&grant.window),
                    Some(&grant.rkey),
                    "a WRITE into window {} under a revoked rkey",
                    grant.window
                );
                let mut digests = Vec::new();
                for e in &grant.extents {
                    if self.seen.verified.contains(&(e.file, e.block)) {
                        self.seen.resent_verified.push((e.file, e.block));
                    }
                    let src = &self.sources[&self.paths[&e.file]];
                    let mut b = self.block(src, e.block, e.len).to_vec();
                    digests.push(digest(check, &b));
                    if self.rng.chance(self.faults.damage) && !b.is_empty() {
                        b[0] ^= 0x5a;
                        self.seen.damaged += 1;
                    }
                    let mem = self.windows.get_mut(&grant.window).expect("granted");
                    mem[e.offset as usize..e.offset as usize + b.len()].copy_from_slice(&b);
                }
                self.client
                    .sent(now, grant.window, grant.round, Ok(digests));
            }
            ClientAction::Fetch { grant } => {
                assert_eq!(
                    self.rkeys.get(&grant.window),
                    Some(&grant.rkey),
                    "a READ of window {} under a revoked rkey",
                    grant.window
                );
                let mut bad = Vec::new();
                for (i, (e, want)) in grant.extents.iter().zip(&grant.digests).enumerate() {
                    if self.seen.verified.contains(&(e.file, e.block)) {
                        self.seen.resent_verified.push((e.file, e.block));
                    }
                    let mem = &self.windows[&grant.window];
                    let mut b = mem[e.offset as usize..e.offset as usize + e.len as usize].to_vec();
                    if self.rng.chance(self.faults.damage) && !b.is_empty() {
                        b[0] ^= 0x5a;
                        self.seen.damaged += 1;
                    }
                    if digest(check, &b) != *want {
                        bad.push(i as u32);
                        continue;
                    }
                    let d = self.dests.get_mut(&e.file).expect("created");
                    let s = (e.block * self.p.block_size) as usize;
                    d.data[s..s + b.len()].copy_from_slice(&b);
                    d.digests.insert(e.block, digest(check, &b));
                    self.seen.verified.insert((e.file, e.block));
                }
                self.client.fetched(now, grant.window, grant.round, Ok(bad));
            }
            ClientAction::Hash { file, blocks } => {
                let src = &self.sources[&self.paths[&file]];
                let len = src.len() as u64;
                let ds = blocks
                    .iter()
                    .map(|&b| {
                        (
                            b,
                            digest(check, self.block(src, b, self.p.block_len(len, b))),
                        )
                    })
                    .collect();
                self.client.hashed(now, file, Ok(ds));
            }
            ClientAction::CheckSource { file } => self.client.source_checked(now, file, Ok(())),
            ClientAction::Commit { files } => {
                for (file, want) in files {
                    let r = self.publish(file, &want);
                    self.client
                        .committed(now, file, r.map(|_| LocalCommit::default()));
                }
            }
            other => panic!("not an I/O action: {other:?}"),
        }
    }

    /// The guarantees of the module docs.
    fn check(&self) {
        assert!(
            self.seen.resent_verified.is_empty(),
            "verified blocks moved again: {:?}",
            self.seen.resent_verified
        );
        assert!(
            self.seen.most_windows <= self.p.window_count as usize,
            "{} windows at once, {} agreed",
            self.seen.most_windows,
            self.p.window_count
        );
        for (w, n) in &self.seen.released {
            assert_eq!(*n, 1, "window {w} released {n} times");
        }
        // Everything published is byte for byte its source.
        let by_path: HashMap<&str, &Vec<u8>> =
            self.sources.iter().map(|(p, d)| (p.as_str(), d)).collect();
        let mut once = HashSet::new();
        for (file, data) in &self.seen.published {
            assert!(once.insert(*file), "file {file} published twice");
            let path = match self.dir {
                Direction::Push => &self.server_paths[file],
                _ => &self.paths[file],
            };
            assert!(
                by_path[path.as_str()] == data,
                "file {file} ({path}) published damaged"
            );
        }
    }

    fn ok(&self) -> bool {
        matches!(self.seen.client_end, Some(Ok(()))) && matches!(self.seen.server_end, Some(Ok(())))
    }

    /// A clean run: every file published, every window released, every file
    /// reported done once.
    fn check_complete(&self) {
        self.check();
        assert!(
            self.ok(),
            "ended {:?} / {:?}",
            self.seen.client_end,
            self.seen.server_end
        );
        assert_eq!(self.seen.published.len(), self.paths.len());
        let mut done = self.seen.done_events.clone();
        done.sort_unstable();
        let mut want: Vec<FileId> = self.paths.keys().copied().collect();
        want.sort_unstable();
        assert_eq!(done, want);
        for w in &self.seen.granted {
            assert_eq!(
                self.seen.released.get(w),
                Some(&1),
                "window {w} not released"
            );
        }
    }
}

fn params() -> Params {
    Params {
        block_size: 4096,
        window_size: 16384,
        window_count: 2,
        max_open_files: 4,
        check: crate::files::Check::Sha256,
        timeout_ns: 10_000_000_000,
        keepalive_ns: 10_000_000_000 / 3,
        max_retries: 3,
        rails: 1,
    }
}

const STEPS: usize = 200_000;

#[test]
fn push_of_small_and_large_files_completes() {
    let files = [0, 1, 4095, 4096, 4097, 20000, 100, 100, 100, 65536];
    let mut s = Sim::new(params(), Direction::Push, &files, Faults::default(), 1);
    s.run(STEPS);
    s.check_complete();
}

#[test]
fn pull_of_small_and_large_files_completes() {
    let files = [0, 1, 4095, 4096, 4097, 20000, 100, 100, 100, 65536];
    let mut s = Sim::new(params(), Direction::Pull, &files, Faults::default(), 2);
    s.run(STEPS);
    s.check_complete();
}

#[test]
fn small_files_share_windows() {
    let mut p = params();
    p.window_size = 1 << 20;
    p.max_open_files = 64;
    p.window_count = 1;
    let files = vec![100u64; 64];
    let mut s = Sim::new(p, Direction::Push, &files, Faults::default(), 3);
    s.run(STEPS);
    s.check_complete();
    // 64 files of one block each in 1 MiB windows of 4 KiB-aligned extents:
    // far fewer windows than files.
    assert!(
        s.seen.granted.len() <= 8,
        "{} windows for 64 tiny files",
        s.seen.granted.len()
    );
}

#[test]
fn damaged_blocks_move_again_and_only_they() {
    for dir in [Direction::Push, Direction::Pull] {
        let files = [50000, 3, 8192, 12000];
        let faults = Faults {
            damage: 0.3,
            ..Faults::default()
        };
        let mut s = Sim::new(params(), dir, &files, faults, 4);
        s.run(STEPS);
        s.check();
        assert!(s.seen.damaged > 0, "the test damaged nothing");
        // With 30% damage and 3 retries a file may fail; if it did, it
        // failed as an integrity error, never as anything else.
        if !s.ok() {
            let e = s.seen.server_end.clone().unwrap().unwrap_err();
            assert_eq!(e.reason, Reason::Integrity, "{e:?}");
        } else {
            s.check_complete();
        }
    }
}

#[test]
fn a_block_damaged_every_time_fails_the_file_as_integrity() {
    let faults = Faults {
        damage: 1.0,
        ..Faults::default()
    };
    let mut s = Sim::new(params(), Direction::Push, &[5000], faults, 5);
    s.run(STEPS);
    s.check();
    assert!(s.seen.published.is_empty());
    let e = s.seen.client_end.clone().unwrap().unwrap_err();
    assert_eq!(e.reason, Reason::Integrity, "{e:?}");
    assert!(e.message.contains("after 3 resends"), "{}", e.message);
}

#[test]
fn duplicated_frames_change_nothing() {
    for dir in [Direction::Push, Direction::Pull] {
        let faults = Faults {
            dup: 0.5,
            damage: 0.1,
            ..Faults::default()
        };
        let files = [9000, 0, 4096, 777, 30000];
        let mut s = Sim::new(params(), dir, &files, faults, 6);
        s.run(STEPS);
        s.check();
        if s.seen.damaged == 0 || s.ok() {
            s.check_complete();
        }
    }
}

#[test]
fn a_lost_frame_ends_both_sides_within_the_timeout() {
    let faults = Faults {
        drop: 0.3,
        ..Faults::default()
    };
    let p = params();
    for seed in 8..40 {
        let mut s = Sim::new(p, Direction::Push, &[9000, 100, 20000, 5], faults, seed);
        s.run(STEPS);
        s.check();
        assert!(s.seen.lost > 0, "seed {seed}: nothing lost");
        let lost_at = s.seen.first_lost_at.unwrap();
        // A lost frame shows at the next frame (a keepalive at the
        // latest): each end that failed failed as retryable, no later on
        // the simulated clock than a timeout after the loss, and nothing
        // unverified was published (`check`).
        for (end, at) in [
            (&s.seen.client_end, s.seen.client_end_at),
            (&s.seen.server_end, s.seen.server_end_at),
        ] {
            let at = at.expect("ended");
            if let Some(Err(e)) = end {
                assert_eq!(e.reason, Reason::Retryable, "seed {seed}: {e:?}");
            }
            assert!(
                at <= lost_at + p.timeout_ns,
                "seed {seed}: ended at {at}, lost at {lost_at}, timeout {}",
                p.timeout_ns
            );
        }
        assert!(!s.ok() || s.seen.published.len() == 4, "seed {seed}");
    }
}

#[test]
fn a_silent_server_ends_the_client_within_the_timeout() {
    let p = params();
    let mut c = ClientCore::new(p, 1, 0);
    c.add_file(FileSpec {
        direction: Direction::Push,
        remote: "x".into(),
        ..FileSpec::default()
    });
    c.finish();
    let mut now = 0;
    let mut ended = None;
    for _ in 0..100 {
        while let Some(a) = c.poll_action() {
            match a {
                ClientAction::OpenSource { file } => c.source_ready(
                    now,
                    file,
                    Ok(SourceMeta {
                        length: 10,
                        ..SourceMeta::default()
                    }),
                ),
                ClientAction::End(r) => ended = Some((now, r)),
                _ => {}
            }
        }
        // Frames go out (the OpenFile, then keepalives) but nothing comes
        // back.
        while c.poll_frame(now).is_some() {}
        if ended.is_some() {
            break;
        }
        now = c.poll_timeout().expect("a timer while waiting");
        c.handle_timeout(now);
    }
    let (at, r) = ended.expect("the client gave up");
    assert_eq!(r.unwrap_err().reason, Reason::Retryable);
    assert!(
        at <= p.timeout_ns,
        "gave up at {at}, timeout {}",
        p.timeout_ns
    );
}

#[test]
fn a_silent_client_is_evicted_and_a_live_idle_one_is_not() {
    let p = params();
    // Silent mid-push: an open file and a granted window, then nothing.
    let mut s = ServerCore::new(p, 0);
    s.handle_frame(
        0,
        ClientFrame {
            session_id: 1,
            open: vec![proto::OpenFile {
                file: 1,
                direction: Direction::Push as i32,
                path: "x".into(),
                length: 5000,
                ..Default::default()
            }],
            ..Default::default()
        },
    );
    let mut ended = None;
    let mut now = 0;
    for _ in 0..100 {
        while let Some(a) = s.poll_action() {
            match a {
                ServerAction::Open { file, open } => s.opened(
                    now,
                    file,
                    Ok(OpenedFile {
                        length: open.length,
                        ..OpenedFile::default()
                    }),
                ),
                ServerAction::Grant { window, round, .. } => s.granted(
                    now,
                    window,
                    round,
                    Ok(Granted {
                        addr: 0,
                        rkey: 1,
                        ..Granted::default()
                    }),
                ),
                ServerAction::End(r) => ended = Some((now, r)),
                _ => {}
            }
        }
        while s.poll_frame(now).is_some() {}
        if ended.is_some() {
            break;
        }
        now = s.poll_timeout().expect("a timer");
        s.handle_timeout(now);
    }
    let (at, r) = ended.expect("evicted");
    assert_eq!(r.unwrap_err().reason, Reason::Retryable);
    assert!(at <= p.timeout_ns);

    // Idle, with keepalives coming: kept.
    let mut s = ServerCore::new(p, 0);
    let mut now = 0;
    for _ in 0..20 {
        now += p.timeout_ns / 2;
        s.handle_frame(now, ClientFrame::default());
        s.handle_timeout(now);
        while s.poll_frame(now).is_some() {}
    }
    assert!(!s.is_ended());
    assert!(s.poll_action().is_none());
}

#[test]
fn keepalives_whose_progress_grows_keep_a_slow_client_and_others_do_not() {
    let p = params();
    // A push with a window granted; the client's WindowDone takes longer
    // than the timeout (a slow link), but its keepalives say bytes land.
    let run = |moving: bool| -> Option<(u64, Failure)> {
        let mut s = ServerCore::new(p, 0);
        s.handle_frame(
            0,
            ClientFrame {
                open: vec![proto::OpenFile {
                    file: 1,
                    direction: Direction::Push as i32,
                    path: "x".into(),
                    length: 5000,
                    ..Default::default()
                }],
                progress: 1,
                ..Default::default()
            },
        );
        let mut now = 0;
        let mut progress = 1;
        for _ in 0..40 {
            while let Some(a) = s.poll_action() {
                match a {
                    ServerAction::Open { file, open } => s.opened(
                        now,
                        file,
                        Ok(OpenedFile {
                            length: open.length,
                            ..OpenedFile::default()
                        }),
                    ),
                    ServerAction::Grant { window, round, .. } => s.granted(
                        now,
                        window,
                        round,
                        Ok(Granted {
                            addr: 0,
                            rkey: 1,
                            ..Granted::default()
                        }),
                    ),
                    ServerAction::End(Err(f)) => return Some((now, f)),
                    _ => {}
                }
            }
            while s.poll_frame(now).is_some() {}
            now += p.keepalive_ns;
            if moving {
                progress += 1;
            }
            s.handle_frame(
                now,
                ClientFrame {
                    progress,
                    ..Default::default()
                },
            );
            s.handle_timeout(now);
        }
        None
    };
    assert!(run(true).is_none(), "a slow but moving client is kept");
    let (at, f) = run(false).expect("a client whose keepalives show no progress is evicted");
    assert_eq!(f.reason, Reason::Retryable);
    assert!(f.message.contains("no progress"), "{}", f.message);
    assert!(at <= p.timeout_ns + p.keepalive_ns);
}

#[test]
fn an_old_or_forged_window_is_refused_or_ignored() {
    let p = params();
    let mut s = ServerCore::new(p, 0);
    // A WindowDone for a window never granted breaks the protocol.
    s.handle_frame(
        0,
        ClientFrame {
            done: vec![proto::WindowDone {
                window: 99,
                ..Default::default()
            }],
            ..Default::default()
        },
    );
    match s.poll_action() {
        Some(ServerAction::End(Err(f))) => {
            assert_eq!(f.reason, Reason::Protocol);
            assert!(f.message.contains("never granted"), "{}", f.message);
        }
        other => panic!("{other:?}"),
    }
}

#[test]
fn file_digest_is_order_fixed() {
    let a = [1u8; 32];
    let b = [2u8; 32];
    let d1 = file_digest(8192, 4096, [&a[..], &b[..]]);
    let d2 = file_digest(8192, 4096, [&b[..], &a[..]]);
    assert_ne!(d1, d2);
    // Independent computation of the documented encoding.
    let mut h = Sha256::new();
    h.update(b"rcp-file-digest-v1\0");
    h.update(8192u64.to_le_bytes());
    h.update(4096u64.to_le_bytes());
    h.update(a);
    h.update(b);
    assert_eq!(d1, h.finalize().to_vec());
    let mut c = DigestChain::new(crate::files::Check::Sha256, 8192, 4096);
    c.add(1, b.to_vec());
    assert!(!c.is_complete());
    c.add(0, a.to_vec());
    assert_eq!(c.finish().unwrap(), d1);
    assert_eq!(file_digest(0, 4096, std::iter::empty()).len(), 32);
}

#[test]
fn id_sets() {
    let mut s = IdSet::starting_at(1);
    assert!(!s.contains(1));
    s.insert(2);
    assert!(s.contains(2) && !s.contains(1));
    s.insert(1);
    assert!(s.contains(1) && s.contains(2) && !s.contains(3));
    assert!(s.above.is_empty(), "compacted");
}

/// A ServerCore that has opened push file 1 (`len` bytes) and granted its
/// first window: the core and that grant's extents.
fn server_with_push_granted(p: Params, len: u64) -> (ServerCore, WindowId, Vec<proto::Extent>) {
    let mut s = ServerCore::new(p, 0);
    s.handle_frame(
        0,
        ClientFrame {
            open: vec![proto::OpenFile {
                file: 1,
                direction: Direction::Push as i32,
                path: "x".into(),
                length: len,
                ..Default::default()
            }],
            ..Default::default()
        },
    );
    let mut granted = None;
    for _ in 0..4 {
        while let Some(a) = s.poll_action() {
            match a {
                ServerAction::Open { file, open } => s.opened(
                    0,
                    file,
                    Ok(OpenedFile {
                        length: open.length,
                        ..OpenedFile::default()
                    }),
                ),
                ServerAction::Grant {
                    window,
                    round,
                    extents,
                    ..
                } => {
                    s.granted(0, window, round, Ok(Granted::default()));
                    granted.get_or_insert((window, extents));
                }
                other => panic!("{other:?}"),
            }
        }
    }
    let (w, e) = granted.expect("a window granted");
    while s.poll_frame(0).is_some() {}
    (s, w, e)
}

/// The outcome of a core fed `frames`, and the I/O it asked for after
/// the first of them.
fn end_of(s: &mut ServerCore, frames: Vec<ClientFrame>) -> (Failure, Vec<String>) {
    let mut acted = Vec::new();
    let mut end = None;
    for f in frames {
        s.handle_frame(1, f);
        while let Some(a) = s.poll_action() {
            match a {
                ServerAction::End(r) => end = Some(r),
                ServerAction::Release { .. } | ServerAction::Close { .. } => {}
                a => acted.push(format!("{a:?}")),
            }
        }
    }
    let f = end.expect("the stream ended").expect_err("as a failure");
    (f, acted)
}

#[test]
fn messages_outside_the_protocol_end_the_stream_naming_them() {
    let p = params();
    let done = |window| proto::WindowDone {
        window,
        digests: vec![vec![0; 32]],
        ..Default::default()
    };
    let end = |file| proto::FileEnd {
        file,
        digest: vec![0; 32],
    };
    // In the stream's first frame, with nothing open.
    for (frame, what) in [
        (
            ClientFrame {
                done: vec![done(0)],
                ..Default::default()
            },
            "the client broke the protocol: WindowDone: window 0 was never granted",
        ),
        (
            ClientFrame {
                done: vec![done(1)],
                ..Default::default()
            },
            "WindowDone: window 1 was never granted",
        ),
        (
            ClientFrame {
                end: vec![end(0)],
                ..Default::default()
            },
            "FileEnd: file 0 was never opened",
        ),
        (
            ClientFrame {
                end: vec![end(7)],
                ..Default::default()
            },
            "FileEnd: file 7 was never opened",
        ),
    ] {
        let mut s = ServerCore::new(p, 0);
        let (f, acted) = end_of(&mut s, vec![frame]);
        assert_eq!(f.reason, Reason::Protocol, "{what}: {f:?}");
        assert!(f.message.contains(what), "{what}: {}", f.message);
        assert!(acted.is_empty(), "{what}: {acted:?}");
        assert_eq!(s.violation_seen().map(|v| v.by), Some(Side::Client));
    }
    // Later in the stream, with a push open and a window granted: window
    // 0, a window not yet granted, a file never opened, file 0. The stream
    // ends and commits nothing, though the file could have been committed
    // (its window answered with the right digest, then its FileEnd).
    let data = vec![5u8; 4096];
    let good = |w: WindowId| ClientFrame {
        done: vec![proto::WindowDone {
            window: w,
            digests: vec![digest(crate::files::Check::Sha256, &data)],
            ..Default::default()
        }],
        end: vec![proto::FileEnd {
            file: 1,
            digest: file_digest(
                4096,
                4096,
                [digest(crate::files::Check::Sha256, &data).as_slice()],
            ),
        }],
        ..Default::default()
    };
    for (forged, what) in [
        (done(0), "window 0 was never granted"),
        (done(2), "window 2 was never granted"),
        (done(u64::MAX), "was never granted"),
    ] {
        let (mut s, w, _) = server_with_push_granted(p, 4096);
        let (f, acted) = end_of(
            &mut s,
            vec![
                ClientFrame {
                    done: vec![forged],
                    ..Default::default()
                },
                good(w),
            ],
        );
        assert_eq!(f.reason, Reason::Protocol, "{what}: {f:?}");
        assert!(f.message.contains(what), "{what}: {}", f.message);
        assert!(acted.is_empty(), "acted after the violation: {acted:?}");
    }
    for (forged, what) in [
        (end(0), "file 0 was never opened"),
        (end(2), "file 2 was never opened"),
        (end(7), "file 7 was never opened"),
    ] {
        let (mut s, w, _) = server_with_push_granted(p, 4096);
        let (f, acted) = end_of(
            &mut s,
            vec![
                ClientFrame {
                    end: vec![forged],
                    ..Default::default()
                },
                good(w),
            ],
        );
        assert_eq!(f.reason, Reason::Protocol, "{what}: {f:?}");
        assert!(f.message.contains(what), "{what}: {}", f.message);
        assert!(acted.is_empty(), "acted after the violation: {acted:?}");
    }
    // The same good answer alone commits the file: the forged frames were
    // what stopped it.
    let (mut s, w, _) = server_with_push_granted(p, 4096);
    s.handle_frame(1, good(w));
    let mut verify = None;
    while let Some(a) = s.poll_action() {
        if let ServerAction::Verify {
            window, round: 0, ..
        } = a
        {
            verify = Some(window);
        }
    }
    s.verified(1, verify.expect("verified"), 0, Ok(Vec::new()));
    let mut committed = false;
    while let Some(a) = s.poll_action() {
        committed |= matches!(a, ServerAction::Commit { .. });
    }
    assert!(committed, "a clean push commits");
}

#[test]
fn a_file_end_before_opened_is_a_violation() {
    let mut s = ServerCore::new(params(), 0);
    let (f, acted) = end_of(
        &mut s,
        vec![ClientFrame {
            open: vec![proto::OpenFile {
                file: 3,
                direction: Direction::Push as i32,
                path: "x".into(),
                length: 10,
                ..Default::default()
            }],
            end: vec![proto::FileEnd {
                file: 3,
                digest: vec![0; 32],
            }],
            ..Default::default()
        }],
    );
    assert_eq!(f.reason, Reason::Protocol, "{f:?}");
    assert!(
        f.message.contains("FileEnd: file 3 is not open yet"),
        "{}",
        f.message
    );
    // Only the Open went out, before the FileEnd was read.
    assert_eq!(acted.len(), 1, "{acted:?}");
    assert!(acted[0].starts_with("Open "), "{acted:?}");
}

#[test]
fn a_frame_after_abort_is_refused_once_and_changes_nothing() {
    let (mut s, w, _) = server_with_push_granted(params(), 4096);
    s.handle_frame(
        1,
        ClientFrame {
            abort: Some(proto::Abort {
                reason: "bye".into(),
            }),
            ..Default::default()
        },
    );
    match s.poll_action() {
        Some(ServerAction::End(Err(f))) => {
            assert_eq!(f.reason, Reason::Retryable, "{f:?}");
            assert!(f.message.contains("the client aborted: bye"), "{f:?}");
        }
        other => panic!("{other:?}"),
    }
    assert!(
        s.violation_seen().is_none(),
        "the Abort itself is in the protocol"
    );
    // Anything after it: refused (kept, logged once), nothing done.
    for f in [
        ClientFrame {
            done: vec![proto::WindowDone {
                window: w,
                digests: vec![vec![0; 32]],
                ..Default::default()
            }],
            ..Default::default()
        },
        ClientFrame::default(),
        ClientFrame {
            open: vec![proto::OpenFile {
                file: 9,
                direction: Direction::Push as i32,
                ..Default::default()
            }],
            ..Default::default()
        },
    ] {
        s.handle_frame(2, f);
        assert!(s.poll_action().is_none());
        assert!(s.poll_frame(2).is_none());
    }
    let v = s.violation_seen().expect("refused");
    assert_eq!((v.by, v.frame), (Side::Client, FrameKind::AfterAbort));
    assert!(v.to_string().contains("after its Abort"), "{v}");
}

fn sizes() -> impl Strategy<Value = u64> {
    prop_oneof![
        Just(0u64),
        Just(1),
        Just(4095),
        Just(4096),
        Just(4097),
        Just(8192),
        0u64..40_000,
    ]
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 96, .. ProptestConfig::default() })]

    /// Random files, windows, limits, damage, duplicates and action orders:
    /// the guarantees hold, and without lost or reordered frames every file
    /// arrives intact.
    #[test]
    fn random_sessions_keep_the_guarantees(
        files in proptest::collection::vec(sizes(), 0..24),
        bs_shift in 0u32..3,
        win_blocks in 1u64..5,
        window_count in 1u32..4,
        max_open in 1u32..9,
        damage in 0.0f64..0.15,
        dup in 0.0f64..0.3,
        pull in any::<bool>(),
        seed in any::<u64>(),
    ) {
        let bs = 4096u64 << bs_shift;
        let p = Params {
            block_size: bs,
            window_size: bs * win_blocks,
            window_count,
            max_open_files: max_open,
            check: crate::files::Check::Sha256,
            timeout_ns: 10_000_000_000,
            keepalive_ns: 10_000_000_000 / 3,
            max_retries: 3,
            rails: 1,
        };
        let dir = if pull { Direction::Pull } else { Direction::Push };
        let faults = Faults { damage, dup, ..Faults::default() };
        let mut s = Sim::new(p, dir, &files, faults, seed);
        s.run(STEPS);
        s.check();
        if s.ok() {
            s.check_complete();
        } else {
            // Only damage beyond the retries may fail a run without lost
            // frames.
            let e = s.seen.client_end.clone().unwrap().unwrap_err();
            prop_assert_eq!(e.reason, Reason::Integrity, "{:?}", e);
        }
    }

    /// Lost and reordered frames too: the run may fail, but only as
    /// retryable (frames lost: the module docs) or, with damage, as an
    /// integrity error, and nothing unverified or damaged is ever
    /// published.
    #[test]
    fn lossy_links_never_publish_what_was_not_verified(
        files in proptest::collection::vec(sizes(), 1..12),
        drop in 0.0f64..0.2,
        dup in 0.0f64..0.3,
        reorder in any::<bool>(),
        damage in 0.0f64..0.2,
        pull in any::<bool>(),
        seed in any::<u64>(),
    ) {
        let p = params();
        let dir = if pull { Direction::Pull } else { Direction::Push };
        let faults = Faults { damage, dup, drop, reorder };
        let mut s = Sim::new(p, dir, &files, faults, seed);
        s.run(STEPS);
        s.check();
        if !s.ok() {
            for end in [&s.seen.client_end, &s.seen.server_end] {
                if let Some(Err(e)) = end {
                    let damaged = s.seen.damaged > 0;
                    prop_assert!(
                        e.reason == Reason::Retryable
                            || (damaged && e.reason == Reason::Integrity),
                        "{:?}", e
                    );
                }
            }
        }
    }
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 64, .. ProptestConfig::default() })]

    /// A clean session, push or pull, into which one message outside the
    /// protocol is forged at a random point while the server runs: the
    /// stream ends with a violation naming it, the server starts no I/O
    /// after it (no open, grant, verify or commit), and what was published
    /// before it is intact.
    #[test]
    fn an_out_of_protocol_frame_ends_in_a_violation_and_commits_nothing_after_it(
        files in proptest::collection::vec(sizes(), 1..10),
        forgery in 0usize..Forgery::ALL.len(),
        at in any::<u64>(),
        dup in 0.0f64..0.3,
        pull in any::<bool>(),
        seed in any::<u64>(),
    ) {
        let p = params();
        let dir = if pull { Direction::Pull } else { Direction::Push };
        let faults = Faults { dup, ..Faults::default() };
        // The same seed runs the same session: the first run says how
        // long the server runs, the second forges within that.
        let mut clean = Sim::new(p, dir, &files, faults, seed);
        clean.run(STEPS);
        clean.check_complete();
        let last = clean.seen.server_end_step.expect("the server ended");
        let forgery = Forgery::ALL[forgery];
        let mut s = Sim::new(p, dir, &files, faults, seed);
        s.forge = Some(((at % last.max(1) as u64) as usize, forgery));
        s.run(STEPS);
        s.check();
        prop_assert!(s.seen.forged_at.is_some(), "forged before the server ended");
        let (_, what) = forgery.frame(&s.server, files.len());
        let e = s.seen.server_end.clone().unwrap().unwrap_err();
        prop_assert_eq!(e.reason, Reason::Protocol, "{:?}", e);
        prop_assert!(e.message.contains(what), "{:?}: {}", forgery, e.message);
        prop_assert!(
            s.seen.acted_after_forgery.is_empty(),
            "the server acted after the violation: {:?}",
            s.seen.acted_after_forgery
        );
        // The client hears why (unless it was done and gone already).
        if let Some(Err(c)) = &s.seen.client_end {
            prop_assert_eq!(c.reason, Reason::Protocol, "{:?}", c);
        }
    }
}

/// Frames of both kinds stay small enough for gRPC's limit even with the
/// largest windows of tiny files.
#[test]
fn a_window_of_tiny_files_fits_a_frame() {
    let mut p = params();
    p.window_size = 4 << 20;
    p.window_count = 1;
    p.max_open_files = 2000;
    let mut s = ServerCore::new(p, 0);
    let open: Vec<proto::OpenFile> = (1..=1500)
        .map(|i| proto::OpenFile {
            file: i,
            direction: Direction::Pull as i32,
            path: format!("some/longish/path/name/{i:08}"),
            ..Default::default()
        })
        .collect();
    s.handle_frame(
        0,
        ClientFrame {
            open,
            ..Default::default()
        },
    );
    let mut q: VecDeque<ServerAction> = VecDeque::new();
    while let Some(a) = s.poll_action() {
        q.push_back(a);
    }
    for a in q {
        if let ServerAction::Open { file, .. } = a {
            s.opened(
                0,
                file,
                Ok(OpenedFile {
                    length: 10,
                    ..OpenedFile::default()
                }),
            );
        }
    }
    let mut grants = 0;
    while let Some(a) = s.poll_action() {
        if let ServerAction::Grant {
            window,
            round,
            extents,
            ..
        } = a
        {
            grants += 1;
            assert_eq!(extents.len(), 1024, "4 MiB of 4 KiB-aligned extents");
            let ds = vec![vec![0u8; 32]; extents.len()];
            s.granted(
                0,
                window,
                round,
                Ok(Granted {
                    addr: 1,
                    rkey: 2,
                    rail_rkeys: Vec::new(),
                    digests: ds,
                }),
            );
        }
    }
    assert_eq!(grants, 1);
    let f = s.poll_frame(0).unwrap();
    let bytes = prost::Message::encoded_len(&f);
    assert!(bytes < crate::control::MAX_MESSAGE, "{bytes} bytes");
}

#[test]
fn frame_numbers_take_the_next_ignore_the_seen_and_end_at_a_gap() {
    let mut s = FrameSeq::default();
    assert_eq!((s.stamp(), s.stamp()), (1, 2));
    assert_eq!(s.check(0), SeqCheck::Take, "unnumbered");
    assert_eq!(s.check(1), SeqCheck::Take);
    assert_eq!(s.check(1), SeqCheck::Duplicate);
    assert_eq!(s.check(2), SeqCheck::Take);
    assert_eq!(
        s.check(4),
        SeqCheck::Gap {
            expected: 3,
            got: 4
        }
    );
    assert_eq!(FrameSeq::lost(3, 4).reason, Reason::Retryable);

    // On a core: a frame after a gap ends the stream as retryable.
    let p = params();
    let mut c = ClientCore::new(p, 1, 0);
    c.handle_frame(
        0,
        ServerFrame {
            seq: 2,
            ..Default::default()
        },
    );
    match c.poll_action() {
        Some(ClientAction::End(Err(f))) => {
            assert_eq!(f.reason, Reason::Retryable);
            assert!(f.message.contains("frames lost"), "{}", f.message);
        }
        other => panic!("{other:?}"),
    }
}

/// rcpd's choice: the client's first offer that rcpd allows, whatever it
/// does not know passed over; an older peer on either side ends at SHA-256
/// or with an error naming both lists.
#[test]
fn check_negotiation_takes_the_clients_first_allowed() {
    use crate::files::Check::{self, *};
    let w = |cs: &[Check]| {
        cs.iter()
            .map(|&c| check_to_wire(c) as i32)
            .collect::<Vec<_>>()
    };
    let default_offer = w(&crate::files::DEFAULT_CHECKS);
    // Each check alone, against the default RCPD_VERIFY (all of them).
    for c in Check::ALL {
        assert_eq!(choose_check(&w(&[c]), &Check::ALL), Ok(c));
        assert_eq!(accept_check(&[c], check_to_wire(c) as i32), Ok(c));
    }
    // The default offer: blake3 from a new rcpd; sha256 from one that does
    // not allow blake3, or from an rcpd of 2.1, which does not know it (its
    // allowed list has no blake3: the same answer).
    assert_eq!(choose_check(&default_offer, &Check::ALL), Ok(Blake3));
    assert_eq!(
        choose_check(&default_offer, &[Sha256, Xxh3, None]),
        Ok(Sha256)
    );
    assert_eq!(
        accept_check(&crate::files::DEFAULT_CHECKS, check_to_wire(Sha256) as i32),
        Ok(Sha256)
    );
    // The client's order wins over rcpd's.
    assert_eq!(choose_check(&w(&[Xxh3, Blake3]), &Check::ALL), Ok(Xxh3));
    // A client of 2.1: one check, or none at all (SHA-256).
    assert_eq!(choose_check(&w(&[Sha256]), &Check::ALL), Ok(Sha256));
    assert_eq!(choose_check(&[], &Check::ALL), Ok(Sha256));
    // A value from a newer peer is passed over.
    assert_eq!(
        choose_check(&[99, check_to_wire(Blake3) as i32], &Check::ALL),
        Ok(Blake3)
    );
    // Nothing allowed: refused, naming both.
    let e = choose_check(&w(&[Sha256]), &[Blake3]).unwrap_err();
    assert_eq!(e.reason, Reason::Invalid);
    assert!(
        e.message.contains("accepts only the checks blake3")
            && e.message.contains("offered sha256"),
        "{}",
        e.message
    );
    let e = choose_check(&[99], &Check::ALL).unwrap_err();
    assert!(
        e.message.contains("no check this rcpd knows"),
        "{}",
        e.message
    );
    // rcpd answering what was not offered (or nothing) is refused.
    for bad in [check_to_wire(Blake3) as i32, 0, 99] {
        let e = accept_check(&[Sha256, Xxh3], bad).unwrap_err();
        assert_eq!(e.reason, Reason::Invalid, "{bad}");
        assert!(e.message.contains("offered sha256, xxh3"), "{}", e.message);
    }
}

/// Each check, as negotiated, moves files both ways through the cores; with
/// every check but none, damaged blocks are caught and move again.
#[test]
fn every_negotiated_check_moves_files_both_ways() {
    use crate::files::Check;
    let files = [0, 1, 4095, 4096, 4097, 20000, 100, 65536];
    for (i, c) in Check::ALL.into_iter().enumerate() {
        let mut p = params();
        p.check = choose_check(&[check_to_wire(c) as i32], &Check::ALL).unwrap();
        assert_eq!(p.check, c);
        for dir in [Direction::Push, Direction::Pull] {
            let faults = Faults {
                damage: if c.is_none() { 0.0 } else { 0.3 },
                ..Faults::default()
            };
            let mut s = Sim::new(p, dir, &files, faults, 40 + i as u64);
            s.run(STEPS);
            s.check();
            if !c.is_none() {
                assert!(s.seen.damaged > 0, "{c} {dir:?}: nothing damaged");
            }
            if s.ok() {
                s.check_complete();
            } else {
                let e = s.seen.server_end.clone().unwrap().unwrap_err();
                assert_eq!(e.reason, Reason::Integrity, "{c} {dir:?}: {e:?}");
            }
        }
    }
}

/// A window holds a file whole only when every block of it is there, once:
/// those are the files whose source the job that read the window may check.
#[test]
fn files_whole_in_a_window() {
    let ext = |file, block| proto::Extent {
        file,
        block,
        offset: 0,
        len: 1,
    };
    let bs = 4096;
    let lens: HashMap<FileId, u64> = [(1, 100), (2, 3 * bs), (3, 2 * bs), (4, 0), (5, bs)].into();
    let len = |f| lens.get(&f).copied();
    let extents = [
        ext(1, 0),
        // Blocks 0-2 of file 2: whole.
        ext(2, 0),
        ext(2, 1),
        ext(2, 2),
        // File 3: block 0 twice, block 1 elsewhere: not whole.
        ext(3, 0),
        ext(3, 0),
        // File 5: a block it does not have, besides block 0's absence.
        ext(5, 7),
        // File 6: not known.
        ext(6, 0),
    ];
    assert_eq!(files_whole_in(&extents, bs, len), vec![1, 2]);
    assert!(files_whole_in(&[ext(3, 1)], bs, len).is_empty());
    assert_eq!(files_whole_in(&[ext(3, 1), ext(3, 0)], bs, len), vec![3]);
    // A larger file: two of its three blocks here, the last in another
    // window.
    assert!(files_whole_in(&[ext(2, 0), ext(2, 1)], bs, len).is_empty());
    // An empty file has no block to hold: an extent naming one is not it.
    assert!(files_whole_in(&[ext(4, 0)], bs, len).is_empty());
    // One block of a one-block file, beside a file not known.
    assert_eq!(files_whole_in(&[ext(6, 0), ext(5, 0)], bs, len), vec![5]);
}
