"""The papers reproduced: Mooncake (tables and figures on the simulator, Figures 11-12 live) and PrfaaS
(planner, simulation, live)."""
