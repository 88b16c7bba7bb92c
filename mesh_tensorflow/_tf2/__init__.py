"""TF2-native mtf: computations lowered once into TF functions, variables owned by tf.Modules."""
