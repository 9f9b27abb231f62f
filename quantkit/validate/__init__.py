"""`quantkit validate`: a written checkpoint checked for format (`checkpoint`), FP4 packing (`fp4`) and what the
engines will serve from it (`serving`: KV scales, PD pairs); the engines' rules come from `quantkit.engines`."""
