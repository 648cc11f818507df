"""LayerKV (arXiv 2410.00428): layer-wise KV placement, its block tables and its SLO-aware scheduler, pure."""
