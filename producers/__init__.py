"""Engine-side producers: they observe serving engines and publish raw, timestamped facts."""
