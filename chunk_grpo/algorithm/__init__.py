"""The paper: samplers, rollouts, G2RPO branching, noise, sigmas, advantages, chunks, updates."""
