//! Building one chained post: `ibv_send_wr`s linked through `next`, their
//! SGEs, signaled and inline flags. Reused across posts: no allocation on the
//! data path once warm.

use rdma_sys::*;

use crate::engine::{OpKind, WorkRequest};

/// Scratch space for one chain (owned by the posting thread).
#[derive(Default)]
pub struct PostScratch {
    wrs: Vec<ibv_send_wr>,
    sges: Vec<ibv_sge>,
}

// SAFETY: the raw pointers inside point into the scratch's own vectors and are
// only dereferenced by ibv_post_send during a call that borrows it mutably.
unsafe impl Send for PostScratch {}

impl PostScratch {
    pub fn with_capacity(n: usize) -> Self {
        PostScratch {
            wrs: Vec::with_capacity(n),
            sges: Vec::with_capacity(n),
        }
    }

    /// Fill the chain for `reqs`; returns its head. Pointers stay valid until
    /// the next call that mutates the scratch.
    pub(crate) fn build(
        &mut self,
        reqs: &[WorkRequest],
        opcode: impl Fn(OpKind) -> ibv_wr_opcode::Type,
    ) -> *mut ibv_send_wr {
        self.wrs.clear();
        self.sges.clear();
        for r in reqs {
            self.sges.push(ibv_sge {
                addr: r.local.addr,
                length: r.local.len,
                lkey: r.local.lkey,
            });
            // SAFETY: ibv_send_wr is plain old data; all-zero is a valid value.
            let mut wr: ibv_send_wr = unsafe { std::mem::zeroed() };
            wr.wr_id = r.wr_id;
            wr.num_sge = 1;
            wr.opcode = opcode(r.kind);
            let mut flags = 0u32;
            if r.signaled {
                flags |= ibv_send_flags::IBV_SEND_SIGNALED.0;
            }
            if r.inline && r.kind == OpKind::Write {
                flags |= ibv_send_flags::IBV_SEND_INLINE.0;
            }
            wr.send_flags = flags;
            wr.wr.rdma = rdma_t {
                remote_addr: r.remote.addr,
                rkey: r.remote.rkey,
            };
            self.wrs.push(wr);
        }
        // Link after both vectors are final so the pointers cannot move.
        let n = self.wrs.len();
        let sge_base = self.sges.as_mut_ptr();
        let wr_base = self.wrs.as_mut_ptr();
        for i in 0..n {
            // SAFETY: i < n = len of both vectors.
            unsafe {
                let w = wr_base.add(i);
                (*w).sg_list = sge_base.add(i);
                (*w).next = if i + 1 < n {
                    wr_base.add(i + 1)
                } else {
                    std::ptr::null_mut()
                };
            }
        }
        wr_base
    }

    /// Position of `bad` in the last chain.
    pub(crate) fn index_of(&self, bad: *mut ibv_send_wr) -> Option<usize> {
        self.wrs.iter().position(|w| std::ptr::eq(w, bad))
    }

    /// Requests in the last chain, and whether each is signaled (for tests).
    pub fn chain(&self) -> Vec<(u64, bool)> {
        let mut out = Vec::new();
        let mut p = self.wrs.as_ptr();
        if self.wrs.is_empty() {
            return out;
        }
        // SAFETY: walks the chain built by `build`, inside self.wrs.
        unsafe {
            while !p.is_null() {
                out.push((
                    (*p).wr_id,
                    (*p).send_flags & ibv_send_flags::IBV_SEND_SIGNALED.0 != 0,
                ));
                p = (*p).next;
            }
        }
        out
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::engine::{LocalSeg, RemoteSeg};

    #[test]
    fn chains_in_order_with_flags() {
        let reqs: Vec<WorkRequest> = (0..32)
            .map(|i| WorkRequest {
                wr_id: i,
                kind: OpKind::Write,
                local: LocalSeg {
                    addr: 0x1000 * i,
                    len: 4096,
                    lkey: 7,
                },
                remote: RemoteSeg {
                    addr: 0x9000 + i,
                    rkey: 9,
                },
                signaled: i == 31,
                inline: false,
            })
            .collect();
        let mut s = PostScratch::with_capacity(64);
        let head = s.build(&reqs, |_| ibv_wr_opcode::IBV_WR_RDMA_WRITE);
        assert!(!head.is_null());
        let c = s.chain();
        assert_eq!(c.len(), 32);
        assert!(c
            .iter()
            .enumerate()
            .all(|(i, &(id, sig))| id == i as u64 && sig == (i == 31)));
        // SAFETY: reading back what build wrote.
        unsafe {
            assert_eq!((*head.add(5)).wr.rdma.remote_addr, 0x9005);
            assert_eq!((*(*head.add(5)).sg_list).addr, 0x5000);
        }
    }
}
