"""Fleet: regions, the scavenging scheduler, verified rollouts and the cluster-scale simulator."""
