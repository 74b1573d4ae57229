# GPU VMs on Compute Engine: a regional managed instance group running ferry's container with
# the GPU, autohealed on /v2/health/ready, and an autoscaler on ferry's queue signal
# (ferry_inference_load, the requests queued or executing), which each instance reports to Cloud
# Monitoring as custom.googleapis.com/ferry/inference_load.

resource "google_storage_bucket" "models" {
  project                     = var.project
  name                        = var.model_bucket
  location                    = var.region
  uniform_bucket_level_access = true
  public_access_prevention    = "enforced"
  versioning {
    enabled = true
  }
}

resource "google_service_account" "vm" {
  project      = var.project
  account_id   = "${var.name}-vm"
  display_name = "ferry GPU instances ${var.name}"
}

# Least privilege: read the model bucket and the image repository, write logs and metrics.
resource "google_storage_bucket_iam_member" "read_models" {
  bucket = google_storage_bucket.models.name
  role   = "roles/storage.objectViewer"
  member = "serviceAccount:${google_service_account.vm.email}"
}

resource "google_artifact_registry_repository_iam_member" "pull_image" {
  project    = var.project
  location   = var.region
  repository = var.artifact_repository
  role       = "roles/artifactregistry.reader"
  member     = "serviceAccount:${google_service_account.vm.email}"
}

resource "google_project_iam_member" "write_metrics" {
  project = var.project
  role    = "roles/monitoring.metricWriter"
  member  = "serviceAccount:${google_service_account.vm.email}"
}

resource "google_project_iam_member" "write_logs" {
  project = var.project
  role    = "roles/logging.logWriter"
  member  = "serviceAccount:${google_service_account.vm.email}"
}

resource "google_compute_instance_template" "ferry" {
  project      = var.project
  name_prefix  = "${var.name}-"
  machine_type = var.machine_type
  region       = var.region

  # Deep Learning VM image: NVIDIA driver, Docker and the NVIDIA container toolkit.
  disk {
    source_image = "projects/deeplearning-platform-release/global/images/family/common-cu124-debian-11-py310"
    disk_size_gb = 100
    boot         = true
    auto_delete  = true
  }

  guest_accelerator {
    type  = var.accelerator_type
    count = var.accelerator_count
  }

  # GPUs cannot live-migrate.
  scheduling {
    on_host_maintenance = "TERMINATE"
    automatic_restart   = true
  }

  network_interface {
    network    = var.network
    subnetwork = var.subnetwork == "" ? null : var.subnetwork
  }

  service_account {
    email  = google_service_account.vm.email
    scopes = ["cloud-platform"]
  }

  metadata = {
    install-nvidia-driver = "True"
    startup-script = templatefile("${path.module}/startup.sh.tftpl", {
      image            = var.image_uri
      registry         = split("/", var.image_uri)[0]
      model_repository = "gs://${google_storage_bucket.models.name}/${var.model_prefix}"
      project          = var.project
    })
  }

  lifecycle {
    create_before_destroy = true
  }
}

resource "google_compute_health_check" "ready" {
  project             = var.project
  name                = "${var.name}-ready"
  check_interval_sec  = 10
  timeout_sec         = 5
  healthy_threshold   = 1
  unhealthy_threshold = 3
  http_health_check {
    port         = 8000
    request_path = "/v2/health/ready"
  }
}

# Google's health checkers reach the instances on the KServe HTTP port.
resource "google_compute_firewall" "health_checks" {
  project       = var.project
  name          = "${var.name}-health-checks"
  network       = var.network
  source_ranges = ["35.191.0.0/16", "130.211.0.0/22"]
  allow {
    protocol = "tcp"
    ports    = ["8000"]
  }
}

resource "google_compute_region_instance_group_manager" "ferry" {
  project            = var.project
  name               = var.name
  region             = var.region
  base_instance_name = var.name

  version {
    instance_template = google_compute_instance_template.ferry.id
  }

  named_port {
    name = "http"
    port = 8000
  }
  named_port {
    name = "grpc"
    port = 8001
  }

  auto_healing_policies {
    health_check      = google_compute_health_check.ready.id
    initial_delay_sec = 600
  }

  update_policy {
    type                  = "PROACTIVE"
    minimal_action        = "REPLACE"
    max_surge_fixed       = 3
    max_unavailable_fixed = 0
  }
}

resource "google_compute_region_autoscaler" "ferry" {
  project = var.project
  name    = var.name
  region  = var.region
  target  = google_compute_region_instance_group_manager.ferry.id

  autoscaling_policy {
    min_replicas    = var.min_replicas
    max_replicas    = var.max_replicas
    cooldown_period = 300
    metric {
      name   = "custom.googleapis.com/ferry/inference_load"
      target = var.target_inference_load
      type   = "GAUGE"
    }
  }
}
