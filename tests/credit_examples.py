"""miles-credit v2026.2.0's ``config/gen_2/examples/`` transcribed ONCE, as dicts (CI has no
network; each function returns a fresh copy of the tag's text): the tests map, plan and train
them with only their paths, variable names and sizes changed.

* :func:`wxformer_era5_025deg` -- ``wxformer_era5_025deg_6hr.yml``;
* :func:`example_v2026` -- ``example-v2026.2.yml`` (the template a CREDIT user starts from);
* :func:`example_end_to_end` -- ``example-end-to-end.yml`` (its YAML anchors as shared objects);
* :func:`wxformer_npj_era5_028deg` -- ``wxformer_npj_era5_028deg.yml`` (its ``&epochs`` anchor
  as the one value).
"""

from __future__ import annotations

__all__ = [
    "DIAGNOSTIC",
    "E025_MEAN",
    "E025_STATIC",
    "E025_STD",
    "E025_STORE",
    "V2026_BASE",
    "V2026_LEVELS",
    "V2026_STATIC",
    "example_end_to_end",
    "example_v2026",
    "wxformer_era5_025deg",
    "wxformer_npj_era5_028deg",
]

E025_LEVELS = [25.5, 75.0, 125.0, 175.0, 225.0, 275.0, 350.0, 450.0, 550.0, 650.0, 775.0]
E025_LEVELS += [887.5, 962.5]
E025_BASE = "/glade/campaign/cisl/aiml/ksha/CREDIT_data/ERA5_plevel_base"
E025_PER_YEAR = E025_BASE + "/all_in_one/ERA5_plevel_6h_%Y.zarr"  # the prognostic group's path
E025_PER_YEAR_STAR = E025_BASE + "/all_in_one/ERA5_plevel_6h_%Y*.zarr"  # the other groups' path
E025_STORE = (
    E025_BASE + "/all_in_one/ERA5_plevel_6h_[0-9][0-9][0-9][0-9].zarr"
)  # both: one year glob
E025_STATIC = E025_BASE + "/static/ERA5_plevel_6h_static.zarr"
E025_MEAN = E025_BASE + "/mean_std/mean_6h_1979_2019_13lev_0.25deg.nc"
E025_STD = E025_BASE + "/mean_std/std_6h_1979_2019_13lev_0.25deg.nc"
DIAGNOSTIC = [
    "total_precipitation",
    "evaporation",
    "top_net_thermal_radiation",
    "top_net_solar_radiation",
    "surface_latent_heat_flux",
    "surface_net_solar_radiation",
    "surface_net_thermal_radiation",
    "surface_sensible_heat_flux",
]


def wxformer_era5_025deg() -> dict:
    """``wxformer_era5_025deg_6hr.yml`` of miles-credit v2026.2.0 as written (every block:
    data, validation_data, trainer, preblocks, model, loss, inference, pbs)."""
    return {
        "save_loc": "/glade/derecho/scratch/$USER/CREDIT_runs/wxformer_025deg_6hr_v2",
        "seed": 1000,
        "data": {
            "source": {
                "ERA5": {
                    "dataset_type": "local",
                    "level_coord": "level",
                    "levels": list(E025_LEVELS),
                    "variables": {
                        "prognostic": {
                            "vars_3D": ["U", "V", "T", "specific_total_water"],
                            "vars_2D": ["SP", "VAR_2T", "VAR_10U", "VAR_10V"],
                            "path": E025_PER_YEAR,
                        },
                        "diagnostic": {"vars_2D": list(DIAGNOSTIC), "path": E025_PER_YEAR_STAR},
                        "dynamic_forcing": {
                            "vars_2D": ["toa_incident_solar_radiation", "land_sea_CI_mask"],
                            "path": E025_PER_YEAR_STAR,
                        },
                        "static": {"vars_2D": ["z_norm", "land_sea_mask"], "path": E025_STATIC},
                    },
                }
            },
            "start_datetime": "1979-01-01",
            "end_datetime": "2018-12-31",
            "timestep": "6h",
            "history_len": 1,
            "forecast_len": 1,
            "one_shot": True,
            "lead_time_periods": 6,
            "skip_periods": None,
            "static_first": True,
            "scaler_type": "std_new",
            "mean_path": E025_MEAN,
            "std_path": E025_STD,
        },
        "validation_data": {
            "source": {
                "ERA5": {
                    "dataset_type": "local",
                    "level_coord": "level",
                    "levels": list(E025_LEVELS),
                    "variables": {
                        "prognostic": {
                            "vars_3D": ["U", "V", "T", "specific_total_water"],
                            "vars_2D": ["SP", "VAR_2T", "VAR_10U", "VAR_10V"],
                            "path": E025_PER_YEAR,
                        },
                        "diagnostic": {"vars_2D": list(DIAGNOSTIC), "path": E025_PER_YEAR_STAR},
                        "dynamic_forcing": {
                            "vars_2D": ["toa_incident_solar_radiation", "land_sea_CI_mask"],
                            "path": E025_PER_YEAR_STAR,
                        },
                        "static": {"vars_2D": ["z_norm", "land_sea_mask"], "path": E025_STATIC},
                    },
                }
            },
            "start_datetime": "2018-01-01",
            "end_datetime": "2019-12-31",
            "timestep": "6h",
            "history_len": 1,
            "forecast_len": 1,
            "one_shot": True,
            "lead_time_periods": 6,
            "skip_periods": None,
            "static_first": True,
            "scaler_type": "std_new",
            "mean_path": E025_MEAN,
            "std_path": E025_STD,
        },
        "trainer": {
            "type": "gen2",
            "parallelism": {"data": "ddp", "tensor": 1, "domain": 1},
            "activation_checkpoint": True,
            "load_weights": False,
            "load_optimizer": False,
            "load_scaler": False,
            "load_scheduler": False,
            "skip_validation": False,
            "update_learning_rate": False,
            "save_backup_weights": True,
            "save_best_weights": True,
            "learning_rate": 0.001,
            "weight_decay": 0,
            "train_batch_size": 2,
            "valid_batch_size": 2,
            "batches_per_epoch": 0,
            "valid_batches_per_epoch": 100,
            "stopping_patience": 999,
            "start_epoch": 0,
            "num_epoch": 5,
            "reload_epoch": False,
            "epochs": 70,
            "use_tensorboard": True,
            "use_ema": True,
            "ema_decay": 0.9999,
            "use_scheduler": True,
            "scheduler": {
                "scheduler_type": "linear-warmup-cosine",
                "warmup_steps": 1000,
                "total_steps": 500000,
                "min_lr": 1e-05,
            },
            "amp": False,
            "grad_accum_every": 1,
            "grad_max_norm": "dynamic",
            "thread_workers": 4,
            "valid_thread_workers": 4,
            "prefetch_factor": 4,
        },
        "preblocks": {
            "per_step": {
                "norm": {
                    "type": "era5_normalizer",
                    "args": {"mean_path": E025_MEAN, "std_path": E025_STD},
                },
                "concat": {"type": "concat"},
            }
        },
        "model": {
            "type": "crossformer",
            "frames": 1,
            "image_height": 721,
            "image_width": 1440,
            "levels": 13,
            "channels": 4,
            "surface_channels": 4,
            "input_only_channels": 4,
            "output_only_channels": 8,
            "patch_width": 1,
            "patch_height": 1,
            "frame_patch_size": 1,
            "dim": [128, 256, 512, 1024],
            "depth": [2, 2, 8, 2],
            "global_window_size": [10, 5, 2, 1],
            "local_window_size": 10,
            "cross_embed_kernel_sizes": [[4, 8, 16, 32], [2, 4], [2, 4], [2, 4]],
            "cross_embed_strides": [2, 2, 2, 2],
            "attn_dropout": 0.0,
            "ff_dropout": 0.0,
            "interp": True,
            "use_spectral_norm": True,
            "padding_conf": {
                "activate": True,
                "mode": "earth",
                "pad_lat": [40, 40],
                "pad_lon": [80, 80],
            },
            "post_conf": {
                "activate": True,
                "tracer_fixer": {
                    "activate": True,
                    "denorm": True,
                    "tracer_name": ["specific_total_water"],
                    "tracer_thres": ["1e-8"],
                },
            },
        },
        "loss": {
            "training_loss": "mse",
            "use_power_loss": False,
            "use_spectral_loss": False,
            "use_latitude_weights": True,
            "latitude_weights": E025_STATIC,
            "use_variable_weights": False,
        },
        "inference": {
            "run_mode": "batch",
            "mode": "ddp",
            "save_forecast": "/glade/derecho/scratch/$USER/CREDIT_runs/wxformer_025deg_6hr_v2",
            "batch_forecast": {
                "forecast_length": "1d",
                "first_init_date": "2020-01-01",
                "last_init_date": "2020-01-02",
                "init_interval": "12h",
            },
            "single_forecast": {"forecast_length": "10d", "start_datetime": "2020-01-01T00:00Z"},
            "output": {
                "format": "netcdf",
                "output_interval": None,
                "group_by": None,
                "variables": None,
                "metadata": "era5.yaml",
                "encoding": {"dtype": "float32", "zlib": True, "complevel": 4},
            },
        },
        "pbs": {
            "conda": "credit-derecho",
            "project": "NAML0001",
            "job_name": "wxformer_025deg_6hr_v2",
            "walltime": "12:00:00",
            "nodes": 8,
            "ncpus": 64,
            "ngpus": 4,
            "mem": "480GB",
            "queue": "main",
        },
    }


V2026_BASE = "/glade/campaign/cisl/aiml/ksha/CREDIT_data/ERA5_mlevel_1deg"
V2026_PER_YEAR = V2026_BASE + "/all_in_one/ERA5_mlevel_1deg_6h_subset_%Y*"
V2026_STATIC = V2026_BASE + "/static/ERA5_mlevel_1deg_static_subset.zarr"
V2026_LEVELS = [
    1.0,
    9.0,
    19.0,
    29.0,
    39.0,
    49.0,
    59.0,
    69.0,
    79.0,
    89.0,
    97.0,
    104.0,
    111.0,
    116.0,
    122.0,
    126.0,
    131.0,
    136.0,
]


def example_v2026() -> dict:
    """``example-v2026.2.yml`` as written (v2026.2.0)."""
    return {
        "save_loc": "/glade/derecho/scratch/$USER/CREDIT_runs/starter_gen2",
        "seed": 1000,
        "data": {
            "source": {
                "ERA5": {
                    "dataset_type": "local",
                    "level_coord": "level",
                    "levels": list(V2026_LEVELS),
                    "variables": {
                        "prognostic": {
                            "vars_3D": [
                                "u_component_of_wind",
                                "v_component_of_wind",
                                "temperature",
                                "specific_total_water",
                            ],
                            "vars_2D": ["SP", "VAR_2T", "VAR_10U", "VAR_10V"],
                            "path": V2026_PER_YEAR,
                        },
                        "diagnostic": {"vars_2D": list(DIAGNOSTIC), "path": V2026_PER_YEAR},
                        "dynamic_forcing": {
                            "vars_2D": ["toa_incident_solar_radiation", "land_sea_CI_mask"],
                            "path": V2026_PER_YEAR,
                        },
                        "static": {"vars_2D": ["z_norm", "land_sea_mask"], "path": V2026_STATIC},
                    },
                }
            },
            "start_datetime": "1979-01-01",
            "end_datetime": "2018-12-31",
            "timestep": "6h",
            "history_len": 1,
            "forecast_len": 1,
            "one_shot": True,
            "lead_time_periods": 6,
            "skip_periods": None,
        },
        "validation_data": {
            "source": {
                "ERA5": {
                    "dataset_type": "local",
                    "level_coord": "level",
                    "levels": list(V2026_LEVELS),
                    "variables": {
                        "prognostic": {
                            "vars_3D": [
                                "u_component_of_wind",
                                "v_component_of_wind",
                                "temperature",
                                "specific_total_water",
                            ],
                            "vars_2D": ["SP", "VAR_2T", "VAR_10U", "VAR_10V"],
                            "path": V2026_PER_YEAR,
                        },
                        "diagnostic": {"vars_2D": list(DIAGNOSTIC), "path": V2026_PER_YEAR},
                        "dynamic_forcing": {
                            "vars_2D": ["toa_incident_solar_radiation", "land_sea_CI_mask"],
                            "path": V2026_PER_YEAR,
                        },
                        "static": {"vars_2D": ["z_norm", "land_sea_mask"], "path": V2026_STATIC},
                    },
                }
            },
            "start_datetime": "2019-01-01",
            "end_datetime": "2020-12-31",
            "timestep": "6h",
            "history_len": 1,
            "forecast_len": 1,
            "one_shot": True,
            "lead_time_periods": 6,
            "skip_periods": None,
        },
        "trainer": {
            "type": "gen2",
            "parallelism": {"data": "ddp", "tensor": 1, "domain": 1},
            "activation_checkpoint": True,
            "load_weights": False,
            "load_optimizer": False,
            "load_scaler": False,
            "load_scheduler": False,
            "reload_epoch": False,
            "skip_validation": False,
            "update_learning_rate": False,
            "save_backup_weights": True,
            "save_best_weights": True,
            "learning_rate": 0.001,
            "weight_decay": 0,
            "train_batch_size": 8,
            "valid_batch_size": 8,
            "batches_per_epoch": 5,
            "valid_batches_per_epoch": 100,
            "stopping_patience": 999,
            "start_epoch": 0,
            "num_epoch": 1,
            "epochs": 70,
            "use_tensorboard": True,
            "use_ema": True,
            "ema_decay": 0.9999,
            "use_scheduler": True,
            "scheduler": {
                "scheduler_type": "linear-warmup-cosine",
                "warmup_steps": 1000,
                "total_steps": 500000,
                "min_lr": 1e-05,
            },
            "amp": False,
            "grad_accum_every": 1,
            "grad_max_norm": "dynamic",
            "thread_workers": 4,
            "valid_thread_workers": 4,
            "prefetch_factor": 4,
        },
        "preblocks": {
            "per_step": {
                "scaler": {
                    "type": "bridgescaler_transform",
                    "args": {
                        "scaler_path": "/glade/campaign/cisl/aiml/credit/credit_scalers/ERA5_mlevel_1deg_6h_bridgescaler_pre.json",
                        "variables": [
                            "ERA5/prognostic/3d/u_component_of_wind",
                            "ERA5/prognostic/3d/v_component_of_wind",
                            "ERA5/prognostic/3d/temperature",
                            "ERA5/prognostic/3d/specific_total_water",
                            "ERA5/prognostic/2d/SP",
                            "ERA5/prognostic/2d/VAR_2T",
                            "ERA5/prognostic/2d/VAR_10U",
                            "ERA5/prognostic/2d/VAR_10V",
                            "ERA5/dynamic_forcing/2d/toa_incident_solar_radiation",
                            "ERA5/diagnostic/2d/total_precipitation",
                            "ERA5/diagnostic/2d/evaporation",
                            "ERA5/diagnostic/2d/top_net_thermal_radiation",
                            "ERA5/diagnostic/2d/top_net_solar_radiation",
                            "ERA5/diagnostic/2d/surface_latent_heat_flux",
                            "ERA5/diagnostic/2d/surface_net_solar_radiation",
                            "ERA5/diagnostic/2d/surface_net_thermal_radiation",
                            "ERA5/diagnostic/2d/surface_sensible_heat_flux",
                        ],
                        "method": "transform",
                        "scaler_params": {"channels_last": False},
                    },
                },
                "concat": {"type": "concat"},
            }
        },
        "postblocks": {
            "per_step": {
                "reconstruct": {"type": "reconstruct", "args": {"detach": False}},
                "scaler": {
                    "type": "bridgescaler_transform",
                    "args": {
                        "scaler_path": "/glade/campaign/cisl/aiml/credit/credit_scalers/ERA5_mlevel_1deg_6h_bridgescaler_pre.json",
                        "variables": [],
                        "method": "inverse_transform",
                    },
                },
                "reconstruct_target": {
                    "type": "reconstruct",
                    "args": {"in_key": "y", "out_key": "y_target_processed"},
                },
                "scaler_target": {
                    "type": "bridgescaler_transform",
                    "args": {
                        "scaler_path": "/glade/campaign/cisl/aiml/credit/credit_scalers/ERA5_mlevel_1deg_6h_bridgescaler_pre.json",
                        "variables": [],
                        "method": "inverse_transform",
                        "key": "y_target_processed",
                    },
                },
            }
        },
        "model": {
            "type": "wxformer",
            "frames": 1,
            "image_height": 181,
            "image_width": 360,
            "levels": 18,
            "channels": 4,
            "surface_channels": 4,
            "input_only_channels": 4,
            "output_only_channels": 8,
            "patch_width": 1,
            "patch_height": 1,
            "frame_patch_size": 1,
            "dim": [32, 64, 128, 256],
            "depth": [2, 2, 8, 2],
            "global_window_size": [8, 4, 2, 1],
            "local_window_size": 4,
            "cross_embed_kernel_sizes": [[4, 8, 16, 32], [2, 4], [2, 4], [2, 4]],
            "cross_embed_strides": [2, 2, 2, 2],
            "attn_dropout": 0.0,
            "ff_dropout": 0.0,
            "interp": True,
            "use_spectral_norm": True,
            "upsample_with_ps": True,
            "padding_conf": {
                "activate": True,
                "mode": "earth",
                "pad_lat": [37, 38],
                "pad_lon": [12, 12],
            },
        },
        "loss": {
            "type": "base",
            "args": {
                "training_loss": "mse",
                "base_loss_parameters": {},
                "var_weighting": "inverse_variance",
                "scaler_path": "/glade/campaign/cisl/aiml/credit/credit_scalers/ERA5_mlevel_1deg_6h_bridgescaler_pre.json",
                "variable_weights": {},
                "normalize_weights": True,
                "include_computed_diagnostics": True,
                "use_latitude_weights": True,
                "latitude_weights": V2026_STATIC,
            },
        },
        "inference": {
            "run_mode": "batch",
            "mode": "ddp",
            "save_forecast": "/glade/derecho/scratch/$USER/CREDIT_runs/starter_v2",
            "batch_forecast": {
                "forecast_length": "1d",
                "first_init_date": "2020-01-01",
                "last_init_date": "2020-01-01",
                "init_interval": "12h",
            },
            "single_forecast": {"forecast_length": "10d", "start_datetime": "2020-01-01T00:00Z"},
            "output": {
                "format": "netcdf",
                "output_interval": None,
                "group_by": None,
                "variables": None,
                "metadata": "era5.yaml",
                "encoding": {"dtype": "float32", "zlib": True, "complevel": 4},
            },
        },
        "pbs": {
            "conda": "credit-derecho",
            "project": "NAML0001",
            "job_name": "wxformer_1deg_6hr_gen2",
            "walltime": "12:00:00",
            "nodes": 8,
            "ncpus": 64,
            "ngpus": 4,
            "mem": "480GB",
            "queue": "main",
        },
    }


def example_end_to_end() -> dict:
    """``example-end-to-end.yml`` as written (v2026.2.0; its YAML anchors as shared objects)."""
    conf = {
        "save_loc": "/glade/derecho/scratch/$USER/CREDIT_runs/starter_gen2",
        "seed": 1000,
        "data": {
            "source": {
                "ERA5": {
                    "dataset_type": "local",
                    "level_coord": "level",
                    "levels": list(V2026_LEVELS),
                    "variables": {
                        "prognostic": {
                            "vars_3D": [
                                "u_component_of_wind",
                                "v_component_of_wind",
                                "temperature",
                                "specific_total_water",
                            ],
                            "vars_2D": ["SP", "VAR_2T", "VAR_10U", "VAR_10V"],
                            "path": V2026_PER_YEAR,
                        },
                        "diagnostic": {"vars_2D": list(DIAGNOSTIC), "path": V2026_PER_YEAR},
                        "dynamic_forcing": {
                            "vars_2D": ["toa_incident_solar_radiation", "land_sea_CI_mask"],
                            "path": V2026_PER_YEAR,
                        },
                        "static": {"vars_2D": ["z_norm", "land_sea_mask"], "path": V2026_STATIC},
                    },
                }
            },
            "start_datetime": "1979-01-01",
            "end_datetime": "2018-12-31",
            "timestep": "6h",
            "history_len": 1,
            "forecast_len": 1,
        },
        "validation_data": {
            "source": {
                "ERA5": {
                    "dataset_type": "local",
                    "level_coord": "level",
                    "levels": list(V2026_LEVELS),
                    "variables": {
                        "prognostic": {
                            "vars_3D": [
                                "u_component_of_wind",
                                "v_component_of_wind",
                                "temperature",
                                "specific_total_water",
                            ],
                            "vars_2D": ["SP", "VAR_2T", "VAR_10U", "VAR_10V"],
                            "path": V2026_PER_YEAR,
                        },
                        "diagnostic": {"vars_2D": list(DIAGNOSTIC), "path": V2026_PER_YEAR},
                        "dynamic_forcing": {
                            "vars_2D": ["toa_incident_solar_radiation", "land_sea_CI_mask"],
                            "path": V2026_PER_YEAR,
                        },
                        "static": {"vars_2D": ["z_norm", "land_sea_mask"], "path": V2026_STATIC},
                    },
                }
            },
            "start_datetime": "2019-01-01",
            "end_datetime": "2020-12-31",
            "timestep": "6h",
            "history_len": 1,
            "forecast_len": 1,
        },
        "trainer": {
            "type": "gen2",
            "parallelism": {"data": "ddp", "tensor": 1, "domain": 1},
            "activation_checkpoint": True,
            "load_weights": False,
            "load_optimizer": False,
            "load_scaler": False,
            "load_scheduler": False,
            "reload_epoch": False,
            "skip_validation": False,
            "update_learning_rate": False,
            "save_backup_weights": True,
            "save_best_weights": True,
            "learning_rate": 0.001,
            "weight_decay": 0,
            "train_batch_size": 4,
            "valid_batch_size": 4,
            "batches_per_epoch": 5,
            "valid_batches_per_epoch": 5,
            "stopping_patience": 999,
            "start_epoch": 0,
            "num_epoch": 2,
            "epochs": 2,
            "use_tensorboard": True,
            "use_ema": True,
            "ema_decay": 0.9999,
            "use_scheduler": True,
            "scheduler": {
                "scheduler_type": "linear-warmup-cosine",
                "warmup_steps": 1000,
                "total_steps": 500000,
                "min_lr": 1e-05,
            },
            "amp": False,
            "grad_accum_every": 1,
            "grad_max_norm": "dynamic",
            "thread_workers": 4,
            "valid_thread_workers": 4,
            "prefetch_factor": 4,
        },
        "preblocks": {
            "per_step": {
                "to_device": {"type": "to_device", "args": {"device": "cuda"}},
                "log_trans": {
                    "type": "log_transform",
                    "args": {"variables": "ERA5/diagnostic/2d/total_precipitation"},
                },
                "scaler": {
                    "type": "bridgescaler_transform",
                    "args": {
                        "scaler_path": "/glade/derecho/scratch/$USER/CREDIT_runs/starter_gen2/ERA5_mlevel_1deg_6h_bridgescaler_pre.json",
                        "data_types": ["input", "target"],
                        "variables": [
                            "ERA5/prognostic/3d/u_component_of_wind",
                            "ERA5/prognostic/3d/v_component_of_wind",
                            "ERA5/prognostic/3d/temperature",
                            "ERA5/prognostic/3d/specific_total_water",
                            "ERA5/prognostic/2d/SP",
                            "ERA5/prognostic/2d/VAR_2T",
                            "ERA5/prognostic/2d/VAR_10U",
                            "ERA5/prognostic/2d/VAR_10V",
                            "ERA5/dynamic_forcing/2d/toa_incident_solar_radiation",
                            "ERA5/diagnostic/2d/total_precipitation",
                            "ERA5/diagnostic/2d/evaporation",
                            "ERA5/diagnostic/2d/top_net_thermal_radiation",
                            "ERA5/diagnostic/2d/top_net_solar_radiation",
                            "ERA5/diagnostic/2d/surface_latent_heat_flux",
                            "ERA5/diagnostic/2d/surface_net_solar_radiation",
                            "ERA5/diagnostic/2d/surface_net_thermal_radiation",
                            "ERA5/diagnostic/2d/surface_sensible_heat_flux",
                        ],
                        "spatial_variables": ["ERA5/prognostic/2d/SP"],
                        "scaler_type": "standard",
                        "scaler_params": {"channels_last": False},
                        "method": "transform",
                    },
                },
                "concat": {"type": "concat"},
            }
        },
        "postblocks": {
            "per_step": {
                "reconstruct": {"type": "reconstruct", "args": {"detach": False}},
                "scaler": {
                    "type": "bridgescaler_transform",
                    "args": {
                        "scaler_path": "/glade/derecho/scratch/$USER/CREDIT_runs/starter_gen2/ERA5_mlevel_1deg_6h_bridgescaler_pre.json",
                        "variables": [],
                        "spatial_variables": ["ERA5/prognostic/2d/SP"],
                        "method": "inverse_transform",
                    },
                },
                "log_trans": {
                    "type": "exp_transform",
                    "args": {"variables": "ERA5/diagnostic/2d/total_precipitation"},
                },
                "reconstruct_target": {
                    "type": "reconstruct",
                    "args": {"in_key": "y", "out_key": "y_target_processed"},
                },
                "scaler_target": {
                    "type": "bridgescaler_transform",
                    "args": {
                        "scaler_path": "/glade/derecho/scratch/$USER/CREDIT_runs/starter_gen2/ERA5_mlevel_1deg_6h_bridgescaler_pre.json",
                        "variables": [],
                        "spatial_variables": ["ERA5/prognostic/2d/SP"],
                        "method": "inverse_transform",
                        "key": "y_target_processed",
                    },
                },
                "log_trans_target": {
                    "type": "exp_transform",
                    "args": {
                        "variables": "ERA5/diagnostic/2d/total_precipitation",
                        "key": "y_target_processed",
                    },
                },
            }
        },
        "model": {
            "type": "wxformer",
            "frames": 1,
            "image_height": 181,
            "image_width": 360,
            "levels": 18,
            "channels": 4,
            "surface_channels": 4,
            "input_only_channels": 4,
            "output_only_channels": 8,
            "patch_width": 1,
            "patch_height": 1,
            "dim": [32, 64, 128, 256],
            "depth": [2, 2, 8, 2],
            "global_window_size": [8, 4, 2, 1],
            "local_window_size": 4,
            "cross_embed_kernel_sizes": [[4, 8, 16, 32], [2, 4], [2, 4], [2, 4]],
            "cross_embed_strides": [2, 2, 2, 2],
            "attn_dropout": 0.0,
            "ff_dropout": 0.0,
            "interp": True,
            "use_spectral_norm": True,
            "upsample_with_ps": True,
            "padding_conf": {
                "activate": True,
                "mode": "earth",
                "pad_lat": [37, 38],
                "pad_lon": [12, 12],
            },
        },
        "loss": {
            "type": "base",
            "args": {
                "training_loss": "mse",
                "base_loss_parameters": {},
                "var_weighting": "inverse_variance",
                "scaler_path": "/glade/derecho/scratch/$USER/CREDIT_runs/starter_gen2/ERA5_mlevel_1deg_6h_bridgescaler_pre.json",
                "variable_weights": {},
                "normalize_weights": True,
                "include_computed_diagnostics": True,
                "use_latitude_weights": True,
                "latitude_weights": V2026_STATIC,
            },
        },
        "metrics": {
            "type": "combined",
            "args": {
                "metrics": {"rmse": {}, "r2score": {}, "bias": {}},
                "var_weighting": "inverse_variance",
                "scaler_path": "/glade/derecho/scratch/$USER/CREDIT_runs/starter_gen2/ERA5_mlevel_1deg_6h_bridgescaler_pre.json",
                "variable_weights": {},
                "normalize_weights": True,
                "include_computed_diagnostics": True,
                "use_latitude_weights": True,
                "latitude_weights": V2026_STATIC,
            },
        },
        "inference": {
            "run_mode": "batch",
            "mode": "ddp",
            "save_forecast": "/glade/derecho/scratch/$USER/CREDIT_runs/starter_gen2/rollout",
            "postblocks": {
                "per_step": {
                    "reconstruct": {"type": "reconstruct"},
                    "scaler": {
                        "type": "bridgescaler_transform",
                        "args": {
                            "scaler_path": "/glade/derecho/scratch/$USER/CREDIT_runs/starter_gen2/ERA5_mlevel_1deg_6h_bridgescaler_pre.json",
                            "variables": [],
                            "spatial_variables": ["ERA5/prognostic/2d/SP"],
                            "method": "inverse_transform",
                        },
                    },
                    "log_trans": {
                        "type": "exp_transform",
                        "args": {"variables": "ERA5/diagnostic/2d/total_precipitation"},
                    },
                }
            },
            "batch_forecast": {
                "forecast_length": "10d",
                "first_init_date": "2020-01-01",
                "last_init_date": "2020-01-10",
                "init_interval": "12h",
            },
            "single_forecast": {"forecast_length": "10d", "start_datetime": "2020-06-01T00:00Z"},
            "output": {
                "format": "netcdf",
                "output_interval": None,
                "group_by": "day",
                "variables": None,
                "metadata": "era5.yaml",
                "encoding": {"dtype": "float32", "zlib": True, "complevel": 4},
            },
        },
        "pbs": {
            "conda": "credit-derecho",
            "project": "NAML0001",
            "job_name": "wxformer_1deg_6hr_gen2",
            "walltime": "12:00:00",
            "nodes": 8,
            "ncpus": 64,
            "ngpus": 4,
            "mem": "480GB",
            "queue": "main",
        },
    }
    valid = conf["validation_data"]["source"]["ERA5"]
    valid["levels"] = conf["data"]["source"]["ERA5"]["levels"]
    valid["variables"] = conf["data"]["source"]["ERA5"]["variables"]
    return conf


NPJ_Y = "/glade/campaign/cisl/aiml/wchapman/MLWPS/STAGING/y_TOTAL_%Y-*.zarr"
NPJ_SOLAR = "/glade/derecho/scratch/dgagne/credit_solar_nc_1h_0.25deg/solar_irradiance_%Y-*.nc"
NPJ_STATIC = "/glade/campaign/cisl/aiml/ksha/CREDIT_data/static_norm_old.nc"
NPJ_MEAN = "/glade/campaign/cisl/aiml/ksha/CREDIT_data/mean_1h_1979_2018_16lev_0.25deg.nc"
NPJ_STD = "/glade/campaign/cisl/aiml/ksha/CREDIT_data/std_residual_1h_1979_2018_16lev_0.25deg.nc"


def wxformer_npj_era5_028deg() -> dict:
    """``wxformer_npj_era5_028deg.yml`` as written (v2026.2.0): zarr stores per year for the
    prognostic group, netCDF files per year for the solar forcing, a netCDF static file, a
    resume from ``save_loc`` (``load_weights``, ``reload_epoch``) and ``cosine-annealing``
    over ``T_max: *epochs``."""
    epochs = 3  # the &epochs anchor
    return {
        "save_loc": "/glade/derecho/scratch/$USER/CREDIT_runs/wxformer_npj_1h",
        "data": {
            "source": {
                "ERA5": {
                    "dataset_type": "local",
                    "level_coord": "level",
                    "levels": [10, 30, 40, 50, 60, 70, 80, 90, 95, 100, 105, 110, 120, 130]
                    + [136, 137],
                    "variables": {
                        "prognostic": {
                            "vars_3D": ["U", "V", "T", "Q"],
                            "vars_2D": ["SP", "t2m", "V500", "U500", "T500", "Z500", "Q500"],
                            "path": NPJ_Y,
                        },
                        "static": {"vars_2D": ["Z_GDS4_SFC", "LSM"], "path": NPJ_STATIC},
                        "dynamic_forcing": {"vars_2D": ["tsi"], "path": NPJ_SOLAR},
                        "diagnostic": None,
                    },
                }
            },
            "start_datetime": "1979-01-01",
            "end_datetime": "2018-12-31",
            "timestep": "1h",
            "history_len": 1,
            "forecast_len": 1,
            "one_shot": False,
            "skip_periods": None,
        },
        "preblocks": {
            "norm": {
                "type": "era5_normalizer",
                "args": {"mean_path": NPJ_MEAN, "std_path": NPJ_STD},
            }
        },
        "trainer": {
            "type": "gen2",
            "parallelism": {"data": "fsdp2", "tensor": 1, "domain": 1},
            "activation_checkpoint": True,
            "load_weights": True,
            "load_optimizer": False,
            "load_scaler": False,
            "load_scheduler": False,
            "skip_validation": False,
            "update_learning_rate": False,
            "save_backup_weights": True,
            "save_best_weights": True,
            "learning_rate": 1.0e-06,
            "weight_decay": 0,
            "train_batch_size": 1,
            "valid_batch_size": 1,
            "batches_per_epoch": 1000,
            "valid_batches_per_epoch": 0,
            "stopping_patience": 999,
            "start_epoch": 0,
            "num_epoch": 1,
            "reload_epoch": True,
            "epochs": epochs,
            "use_ema": True,
            "ema_decay": 0.9999,
            "use_tensorboard": True,
            "use_scheduler": True,
            "scheduler": {"scheduler_type": "cosine-annealing", "T_max": epochs, "last_epoch": -1},
            "amp": False,
            "grad_accum_every": 1,
            "grad_max_norm": 1.0,
            "thread_workers": 4,
            "valid_thread_workers": 0,
        },
        "model": {
            "type": "wxformer",
            "frames": 1,
            "image_height": 640,
            "image_width": 1280,
            "levels": 16,
            "channels": 4,
            "surface_channels": 7,
            "input_only_channels": 3,
            "output_only_channels": 0,
            "patch_width": 1,
            "patch_height": 1,
            "frame_patch_size": 1,
            "dim": [128, 256, 512, 1024],
            "depth": [2, 2, 8, 2],
            "global_window_size": [10, 5, 2, 1],
            "local_window_size": 10,
            "cross_embed_kernel_sizes": [[4, 8, 16, 32], [2, 4], [2, 4], [2, 4]],
            "cross_embed_strides": [2, 2, 2, 2],
            "attn_dropout": 0.0,
            "ff_dropout": 0.0,
            "interp": False,
            "padding_conf": {"activate": True, "mode": "earth", "pad_lat": 80, "pad_lon": 80},
            "post_conf": {
                "activate": True,
                "tracer_fixer": {
                    "activate": True,
                    "denorm": True,
                    "tracer_name": ["Q", "Q500"],
                    "tracer_thres": ["1e-8", "1e-8"],  # strings, as YAML reads 1e-8
                },
            },
        },
        "loss": {
            "training_loss": "mse",
            "use_power_loss": False,
            "use_spectral_loss": False,
            "use_latitude_weights": True,
            "latitude_weights": "/glade/campaign/cisl/aiml/credit/static_scalers/"
            "LSM_static_variables_ERA5_zhght.nc",
            "use_variable_weights": False,
        },
        "inference": {
            "run_mode": "batch",
            "mode": "none",
            "save_forecast": "/glade/derecho/scratch/$USER/CREDIT_runs/wxformer_npj_1h",
            "batch_forecast": {
                "forecast_length": "30d",
                "first_init_date": "2020-01-01",
                "last_init_date": "2020-01-02",
                "init_interval": "12h",
            },
            "single_forecast": {"forecast_length": "30d", "start_datetime": "2020-01-01T00:00Z"},
            "output": {
                "format": "netcdf",
                "output_interval": None,
                "group_by": None,
                "variables": None,
                "metadata": "era5.yaml",
                "encoding": {"dtype": "float32", "zlib": True, "complevel": 4},
            },
        },
        "pbs": {
            "conda": "credit-derecho",
            "project": "NAML0001",
            "job_name": "wxformer_npj_1h",
            "walltime": "12:00:00",
            "nodes": 8,
            "ncpus": 64,
            "ngpus": 4,
            "mem": "480GB",
            "queue": "main",
        },
    }
