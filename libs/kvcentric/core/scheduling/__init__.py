"""The Conductor's pure cores (no I/O, time passed in): `conductor` (Mooncake Algorithm 1 end to end),
`policies` (prefill placement by name), `admission` (decode choice and rejection modes), `bursts` (bursts
queued, overload refused), `correction`
(predicted TTFT corrected from first tokens), `estimators` (T_prefill, T_transfer, decode forecast),
`registry` (load reports + dispatch accounting), `view` (what a policy sees of each candidate at one decision),
`groups` (a pipelined prefill group as one candidate), `prefix` (prefix matching), `eviction` (LRU/LFU/length-aware
block caches), `kvs_gate` (kvs-meta health gating), `clusters` (PrfaaS routing across a PD and a PrfaaS
cluster), `config` (their settings).
The live conductor service and the simulator both drive them."""
