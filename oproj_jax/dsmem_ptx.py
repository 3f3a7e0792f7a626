"""Inline PTX for the cluster exchanges, shared by the CuTe kernel and the Pallas cluster path.

A CTA delivers an f32 into a CTA of its cluster and accounts for it on that CTA's mbarrier;
the receiver waits for the mbarrier's phase 0. Shared-memory addresses are u32 offsets in the
issuing CTA's own shared window (mapa turns them into the peer's).
"""

# $0: the value's address, $1: the f32, $2: the mbarrier's address, $3: the receiving CTA,
# $4: this CTA. To another CTA: st.async completing the bytes on its mbarrier; to this CTA: a
# plain st.shared plus one arrival (st.async is only used across CTAs, as in the verified
# cluster example).
PUT_F32 = (
    "{ .reg .pred own; .reg .b32 d, m; .reg .b64 state;"
    " setp.eq.u32 own, $3, $4;"
    " @own st.shared.f32 [$0], $1;"
    " @own mbarrier.arrive.shared::cta.b64 state, [$2];"
    " @!own mapa.shared::cluster.u32 d, $0, $3;"
    " @!own mapa.shared::cluster.u32 m, $2, $3;"
    " @!own st.async.shared::cluster.mbarrier::complete_tx::bytes.b32 [d], $1, [m]; }"
)

# $0: the mbarrier's address. Spins until its phase 0 completes (every expected byte and arrival).
WAIT_PHASE0 = (
    "{ .reg .pred p; WAIT_${:uid}: mbarrier.try_wait.parity.shared::cta.b64 p, [$0], 0; @!p bra WAIT_${:uid}; }"
)
